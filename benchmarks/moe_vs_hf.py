"""A random-initialised Qwen3-MoE of a chosen shape: fleetllm's decode tok/s against HF transformers', exact fp32.

Both run the same safetensors in fp32 (fleetllm ``--quantization none``), greedy, ``--new`` tokens after a short
prompt: HF's ``generate`` one request at a time (c=1), fleetllm's ``LLM`` at c=1 and c=8 (8 prompts batched).
The first tokens are greedy-checked against each other; each figure is the best of 3 alternating runs. A shape the size of the issue's realistic one (hidden 1024,
64 experts of 512, top 8, 16 layers) takes ~7 GB in fp32: scale ``--layers`` down on a shared machine.

    python benchmarks/moe_vs_hf.py --hidden 512 --experts 32 --expert-width 256 --top-k 4 --layers 8
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import transformers

from fleetllm import LLM, SamplingParams


def build(args: argparse.Namespace, path: str) -> transformers.PreTrainedModel:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
        num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_width,
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=True, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(path)
    from fleetllm.models.loader import load_model

    (open(os.path.join(path, "tokenizer.json"), "w")).write(load_model("smollm2-135m").tokenizer.tok.to_str())
    return model


def hf_tok_s(model: transformers.PreTrainedModel, prompt: list[int], new: int) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return new / (time.perf_counter() - t0), out[0, len(prompt):].tolist()


def fleet_tok_s(llm: LLM, prompts: list[list[int]], new: int) -> tuple[float, list[int]]:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    res = llm.generate(prompts, params)
    return len(prompts) * new / (time.perf_counter() - t0), res[0].outputs[0].token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 512), ("experts", 32), ("expert-width", 256), ("top-k", 4), ("layers", 8),
                          ("new", 64), ("threads", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        hf = build(args, d)
        params = sum(p.numel() for p in hf.parameters())
        prompt = list(range(100, 116))
        # best of 3 each, alternating: a shared machine's other work comes and goes
        llm = LLM(d, quantization="none", num_threads=args.threads)
        batch = [[t + i for t in prompt] for i in range(8)]
        hf1 = fl1 = fl8 = 0.0
        for _ in range(3):
            (h, hf_out), (f, fl_out), (f8, _) = (hf_tok_s(hf, prompt, args.new), fleet_tok_s(llm, [prompt], args.new),
                                                 fleet_tok_s(llm, batch, args.new))
            hf1, fl1, fl8 = max(hf1, h), max(fl1, f), max(fl8, f8)
    same = next((i for i, (a, b) in enumerate(zip(hf_out, fl_out, strict=False)) if a != b), len(fl_out))
    print(f"Qwen3-MoE random: {params / 1e6:.0f}M params, {args.experts} experts x {args.expert_width}, top {args.top_k}, "
          f"{args.layers} layers, hidden {args.hidden}; {args.threads} threads, load {os.getloadavg()[0]:.1f}")
    print(f"HF transformers c=1 {hf1:.1f} tok/s | fleetllm c=1 {fl1:.1f} tok/s ({fl1 / hf1:.2f}x), c=8 {fl8:.1f} tok/s; "
          f"greedy equal for the first {same} of {args.new} tokens")


if __name__ == "__main__":
    main()
