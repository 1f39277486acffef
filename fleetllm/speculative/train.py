"""``fleetllm spec train``: fit an EAGLE or P-EAGLE head to the target's own distributions.

Data come from the target itself, offline: (1) prefill over local text (the Python standard library's
source files), (2) the target's own chat answers to prompts built from stdlib docstrings and code.
Each sequence is run through the target once, keeping the fused-layer features and the final hidden
states; the labels are the target's next-token distributions restricted to the draft vocabulary
(the most frequent tokens of the data). Loss: soft cross-entropy (= KL up to a constant) per depth,
weighted 0.8^d. EAGLE is unrolled as at inference (each draft slot's feature is the head's previous
output); P-EAGLE sees mask slots for depths 2..K in one pass. Training anchors are sampled at random
positions of all sequences every step, so every depth sees every kind of position.
"""

from __future__ import annotations

import ast
import json
import math
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from fleetllm.models.llama import AttentionMetadata, PrefillChunk
from fleetllm.models.loader import LoadedModel, cache_dir, load_model
from fleetllm.speculative.eagle import DraftHead, HeadConfig

DEPTH_WEIGHT = 0.8


# ---- data --------------------------------------------------------------------------------------------
def stdlib_files(seed: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    random.Random(seed).shuffle(files)
    return files


def docstring_prompts(files: list[Path], n: int, seed: int) -> list[str]:
    """Chat prompts from stdlib functions: write-this, explain-this and copy-this-tool-output tasks."""
    rng = random.Random(seed)
    out: list[str] = []
    for path in files:
        try:
            src = path.read_text(errors="ignore")
            tree = ast.parse(src)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not ast.get_docstring(node):
                continue
            doc = ast.get_docstring(node).strip().split("\n")[0]
            code = ast.get_source_segment(src, node) or ""
            kind = rng.randrange(4)
            if kind == 0:
                out.append(f"Write a Python function `{node.name}` that does this: {doc}")
            elif kind == 1:
                out.append(f"Explain what this function does:\n```python\n{code[:600]}\n```")
            elif kind == 2:
                out.append(f"The tool returned:\n{code[:500]}\nRepeat the function signature and first lines, then fix any bug.")
            else:
                out.append(f"{doc} Give a short example in Python.")
            if len(out) >= n:
                return out
    return out


# Chat and tool-output prompts are generated from these lists; none of them is a benchmark prompt.
TOPICS = ["gardening", "learning a language", "saving money", "running a marathon", "baking bread", "public speaking",
          "time management", "photography", "keeping bees", "chess openings", "remote work", "volcanoes",
          "the water cycle", "black holes", "the Roman empire", "electric cars", "recycling", "jazz music",
          "writing a CV", "camping", "meditation", "coffee", "rainforests", "the stock market", "first aid",
          "learning to swim", "birdwatching", "solar panels", "a job interview", "moving to a new city",
          "studying for exams", "healthy breakfasts", "painting with watercolours", "the moon landing",
          "climate change", "hiking safety", "composting", "video games", "friendship", "octopuses"]
FORMS = ["Give me {n} tips for {t}.", "Explain {t} to a ten-year-old.", "Write a short poem about {t}.",
         "What are the pros and cons of {t}?", "Write a short story that involves {t}.",
         "Summarise what someone should know about {t} in {n} bullet points.", "Why do people care about {t}?",
         "Write a friendly email inviting a colleague to a talk about {t}.", "What is a common mistake with {t}?",
         "Answer briefly: what is the most important thing about {t}?"]
WORDS = ["alpha", "beta", "gamma", "delta", "orders", "users", "cache", "queue", "disk", "eu-north-1", "us-east-2",
         "timeout", "retry", "billing", "invoice", "shard", "node-7", "pod-3", "backup", "token"]


def chat_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(FORMS).format(t=rng.choice(TOPICS), n=rng.randint(2, 5)) for _ in range(n)]


def tool_prompts(n: int, seed: int) -> list[str]:
    """Agentic copying: a random tool result (JSON record, log lines, CSV) and an instruction to reuse it."""
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(n):
        kind = rng.randrange(3)
        if kind == 0:
            rec = {rng.choice(WORDS): rng.choice([rng.randint(0, 9999), round(rng.uniform(0, 100), 2), rng.choice(WORDS)])
                   for _ in range(rng.randint(3, 7))}
            rec["items"] = [{"id": f"{rng.choice(WORDS)}-{rng.randint(100, 999)}", "value": rng.randint(1, 500)}
                            for _ in range(rng.randint(1, 4))]
            body = json.dumps(rec)
        elif kind == 1:
            body = "\n".join(f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:"
                             f"{rng.randint(0, 59):02d}:00Z {rng.choice(WORDS)} {rng.choice(['INFO', 'WARN', 'ERROR'])} "
                             f"{rng.choice(WORDS)} {rng.choice(['failed', 'started', 'completed', 'timed out'])} "
                             f"after {rng.randint(1, 90)}s" for _ in range(rng.randint(2, 5)))
        else:
            body = "name,count,status\n" + "\n".join(f"{rng.choice(WORDS)},{rng.randint(0, 300)},{rng.choice(['ok', 'down'])}"
                                                     for _ in range(rng.randint(2, 5)))
        ask = rng.choice(["Repeat the result exactly, then explain it.", "Quote the relevant lines exactly and say what went wrong.",
                          "List every entry in the same format.", "Copy the output verbatim, then summarise it in one sentence."])
        tool = rng.choice(["search", "get_status", "query_db", "read_logs", "list_items"])
        out.append(f"The tool `{tool}` returned:\n{body}\n{ask}")
    return out


@dataclass
class Corpus:
    tokens: torch.Tensor  # [N] all sequences concatenated
    aux: torch.Tensor  # [N, len(aux_layers) * H] target features
    final: torch.Tensor  # [N, H] target final (normed) hidden states
    starts: list[int]  # first index of each sequence
    lengths: list[int]
    kinds: list[str]  # text | chat | code | tool, per sequence
    prompt_lens: list[int]  # tokens before the target's answer (0 for text): drafting starts after them


@torch.inference_mode()
def target_features(loaded: LoadedModel, ids: list[int], aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    model = loaded.model
    cfg = model.cfg
    n = len(ids)
    kv = [(torch.zeros(n, cfg.num_kv_heads, cfg.head_dim), torch.zeros(n, cfg.num_kv_heads, cfg.head_dim)) for _ in model.layers]
    slots = torch.arange(n)
    meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, n, slots, fresh=True)])
    final, aux = model(torch.tensor(ids), slots, meta, kv, aux_layers)
    return aux, final


def build_corpus(loaded: LoadedModel, aux_layers: tuple[int, ...], text_tokens: int, chats: int, seed: int, log) -> Corpus:
    """Stdlib source chunks (prefill only) plus the target's own answers to ``chats`` generated prompts
    (a third each chat, code, tool-output copying; two in three greedy, one sampled at temperature 0.7)."""
    from rich.progress import Progress

    from fleetllm.engine.llm import LLM
    from fleetllm.engine.sampling import SamplingParams

    tok = loaded.tokenizer
    files = stdlib_files(seed)
    seqs: list[tuple[str, list[int]]] = []
    prompt_lens: list[int] = []
    total = 0
    for path in files[len(files) // 2 :]:  # text from one half of the files, code prompts from the other
        ids = tok.encode(path.read_text(errors="ignore"))
        for s in range(0, max(len(ids) - 64, 1), 1024):
            chunk = ids[s : s + 256]
            if len(chunk) >= 64:
                seqs.append(("text", chunk))
                prompt_lens.append(0)
                total += len(chunk)
            if total >= text_tokens:
                break
        if total >= text_tokens:
            break
    log(f"text: {len(seqs)} chunks, {total} tokens")
    third = chats // 3
    prompts = ([("chat", p) for p in chat_prompts(chats - 2 * third, seed)]
               + [("code", p) for p in docstring_prompts(files[: len(files) // 2], third, seed)]
               + [("tool", p) for p in tool_prompts(third, seed)])
    chat_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))[-192:]
                for _, p in prompts]
    llm = LLM(loaded=loaded, num_blocks=4096, max_num_seqs=64, max_num_batched_tokens=2048)
    params = [SamplingParams(max_tokens=160, temperature=0.0 if i % 3 else 0.7, seed=seed + i) for i in range(len(chat_ids))]
    t0, done = time.perf_counter(), 0
    with Progress() as bar:
        task = bar.add_task("own answers", total=len(chat_ids))
        for lo in range(0, len(chat_ids), 64):
            for (kind, _), r in zip(prompts[lo : lo + 64], llm.generate(chat_ids[lo : lo + 64], params[lo : lo + 64]), strict=True):
                seqs.append((kind, r.prompt_token_ids + r.outputs[0].token_ids))
                prompt_lens.append(len(r.prompt_token_ids))
                done += len(r.outputs[0].token_ids)
            bar.update(task, advance=len(chat_ids[lo : lo + 64]))
    log(f"own answers: {len(chat_ids)} ({done} tokens) in {time.perf_counter() - t0:.0f}s")
    del llm
    toks, auxs, finals, starts, lengths = [], [], [], [], []
    n = 0
    with Progress() as bar:
        task = bar.add_task("target features", total=sum(len(s) for _, s in seqs))
        for _, ids in seqs:
            aux, final = target_features(loaded, ids, aux_layers)
            starts.append(n)
            lengths.append(len(ids))
            n += len(ids)
            toks.append(torch.tensor(ids))
            auxs.append(aux.to(torch.bfloat16))
            finals.append(final.to(torch.bfloat16))
            bar.update(task, advance=len(ids))
    return Corpus(torch.cat(toks), torch.cat(auxs), torch.cat(finals), starts, lengths, [k for k, _ in seqs], prompt_lens)


# ---- model init --------------------------------------------------------------------------------------
def init_from_target(head: DraftHead, loaded: LoadedModel, vocab: torch.Tensor) -> None:
    """Start from the target's last decoder layer (a layer that already maps features to predictions)."""
    t = loaded.model
    last = t.layers[-1]
    with torch.no_grad():
        head.draft_to_target.copy_(vocab)
        head.qkv.weight.copy_(last.attn.qkv.weight)
        head.o.weight.copy_(last.attn.o.weight)
        gate, up = last.mlp.gate_up.weight.split(t.cfg.intermediate_size)
        keep = last.mlp.down.weight.norm(dim=0).topk(head.cfg.intermediate_size).indices.sort().values
        head.gate_up.weight.copy_(torch.cat([gate[keep], up[keep]]))
        head.down.weight.copy_(last.mlp.down.weight[:, keep])
        head.attn_norm.weight.copy_(last.input_norm.weight)
        head.mlp_norm.weight.copy_(last.post_attn_norm.weight)
        head.out_norm.weight.copy_(t.norm.weight)
        h = head.cfg.hidden_size
        head.fuse.weight.zero_()
        head.fuse.weight[:, -h:] = torch.eye(h)  # start from the high layer's feature
        head.mask_embed.copy_(t.embed.weight.mean(0))
        head.mask_feature.normal_(0, 0.02)


# ---- training ----------------------------------------------------------------------------------------
class Batcher:
    """Training windows: an anchor is a context position with ``depth`` label positions after it.

    In answers, anchors start where drafting starts at inference (the first draft follows the first
    sampled token): the prompts share a system prompt and templates that a head would otherwise learn
    by heart, scoring well on them and poorly on answers."""

    HOLD_OUT_EVERY = 16  # every 16th sequence is held out, whole (neighbouring windows share tokens)

    def __init__(self, corpus: Corpus, window: int, depth: int, seed: int) -> None:
        self.c, self.w, self.k = corpus, window, depth
        self.starts = torch.tensor(corpus.starts)
        self.gen = torch.Generator().manual_seed(seed)

    def anchors(self, held_out: bool, kind: str | None = None) -> torch.Tensor:
        c, w, k = self.c, self.w, self.k
        return torch.tensor([s + a for i, (s, n, p) in enumerate(zip(c.starts, c.lengths, c.prompt_lens, strict=True))
                             if (i % self.HOLD_OUT_EVERY == 0) == held_out and kind in (None, c.kinds[i])
                             for a in range(max(w - 1, p - 1), n - k - 1)], dtype=torch.long)

    def batch(self, anchors: torch.Tensor) -> dict[str, torch.Tensor]:
        c, w, k = self.c, self.w, self.k
        ctx = anchors.unsqueeze(1) + torch.arange(-w + 1, 1).unsqueeze(0)  # [B, W] global index of f_j
        ahead = anchors.unsqueeze(1) + torch.arange(1, k + 1).unsqueeze(0)  # [B, K] positions whose dist is a label
        start = self.starts[torch.searchsorted(self.starts, anchors, right=True) - 1]
        return {
            "ctx_tok": c.tokens[ctx + 1],  # t_{j+1}
            "ctx_aux": c.aux[ctx].float(),
            "ctx_pos": ctx + 1 - start.unsqueeze(1),
            "ahead_tok": c.tokens[ahead],  # t_{g+1+d}: the token a draft slot d holds (teacher forcing)
            "labels": c.final[ahead].float(),  # final hidden whose LM-head distribution is depth d's label
        }


def depth_logits(head: DraftHead, loaded: LoadedModel, b: dict[str, torch.Tensor], lm_weight: torch.Tensor) -> torch.Tensor:
    """[B, K, Vd] draft logits for each depth, computed the way the drafter runs at inference."""
    t = loaded.model
    emb = t.embed(b["ctx_tok"])
    feats = head.fuse(b["ctx_aux"])
    pos = b["ctx_pos"]
    k = b["labels"].shape[1]
    if head.cfg.method == "peagle":
        bsz, m = emb.shape[0], k - 1
        emb = torch.cat([emb, head.mask_embed.expand(bsz, m, -1)], 1)
        feats = torch.cat([feats, head.mask_feature.expand(bsz, m, -1)], 1)
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, m + 1)], 1)
        h, _ = head(emb, feats, pos, t.rotary)
        return head.logits(h[:, -k:], lm_weight)
    h, past = head(emb, feats, pos, t.rotary)
    h = h[:, -1:]
    outs = [h]
    for d in range(1, k):
        h, past = head(t.embed(b["ahead_tok"][:, d : d + 1]), h, pos[:, -1:] + d, t.rotary, None, past)
        outs.append(h)
    return head.logits(torch.cat(outs, 1), lm_weight)


def loss_and_acc(head, loaded, b, lm_weight) -> tuple[torch.Tensor, torch.Tensor]:
    logits = depth_logits(head, loaded, b, lm_weight)
    with torch.no_grad():
        teacher = torch.log_softmax(F.linear(b["labels"], lm_weight), dim=-1)
    k = logits.shape[1]
    ce = -(teacher.exp() * torch.log_softmax(logits, -1)).sum(-1).mean(0)  # [K]
    weights = DEPTH_WEIGHT ** torch.arange(k, dtype=torch.float32)
    acc = (logits.argmax(-1) == teacher.argmax(-1)).float().mean(0)
    return (ce * weights).sum() / weights.sum(), acc


def cached_corpus(loaded: LoadedModel, aux_layers: tuple[int, ...], target: str, seed: int, text_tokens: int,
                  chats: int) -> Corpus:
    """The training data: built once (it takes the target minutes of generation), then read from the cache."""
    data_path = cache_dir() / f"spec-data-v3-{target}-{seed}-{text_tokens}-{chats}.pt"
    if data_path.exists():
        corpus = Corpus(**torch.load(data_path))
        print(f"data: {len(corpus.tokens)} tokens from {data_path}")
        return corpus
    corpus = build_corpus(loaded, aux_layers, text_tokens, chats, seed, print)
    torch.save(corpus.__dict__, data_path)
    return corpus


@torch.no_grad()
def evaluate(head: DraftHead, loaded: LoadedModel, eval_sets: dict[str, dict], lm_weight: torch.Tensor) -> dict:
    """Held-out loss and top-1 agreement by depth, per kind of data."""
    held_out = {}
    for kind, b in eval_sets.items():
        eval_loss, eval_acc = loss_and_acc(head, loaded, b, lm_weight)
        held_out[kind] = {"loss": round(eval_loss.item(), 3), "top1_by_depth": [round(a, 3) for a in eval_acc.tolist()]}
    return held_out


def train(method: str, target: str, output: Path, minutes: float, batch_size: int, lr: float, seed: int,
          text_tokens: int, chats: int, threads: int) -> dict:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    loaded = load_model(target)
    cfg = HeadConfig.for_target(loaded.model, method, target)
    head = DraftHead(cfg)
    corpus = cached_corpus(loaded, cfg.aux_layers, target, seed, text_tokens, chats)
    counts = torch.bincount(corpus.tokens, minlength=loaded.config.vocab_size)
    with torch.no_grad():  # frequent data tokens and what the target predicts there
        pred = torch.cat([F.linear(corpus.final[i : i + 4096].float(), loaded.model.lm_head.weight).argmax(-1)
                          for i in range(0, len(corpus.final), 4096)])
    counts += torch.bincount(pred, minlength=loaded.config.vocab_size)
    vocab = counts.topk(cfg.draft_vocab_size).indices.sort().values
    init_from_target(head, loaded, vocab)
    lm_weight = loaded.model.lm_head.weight[vocab].detach()
    coverage = float(counts[vocab].sum() / counts.sum())

    batcher = Batcher(corpus, cfg.window, cfg.max_depth, seed)
    train_idx = batcher.anchors(held_out=False)
    eval_sets = {}
    for kind in sorted(set(corpus.kinds)):
        idx = batcher.anchors(held_out=True, kind=kind)
        if len(idx):
            eval_sets[kind] = batcher.batch(idx[torch.randperm(len(idx), generator=batcher.gen)[:384]])
    sizes = ", ".join(f"{k} {len(v['labels'])}" for k, v in eval_sets.items())
    print(f"train windows {len(train_idx)}; held-out windows by kind: {sizes}")
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    budget = minutes * 60
    t0 = time.perf_counter()
    step, ema = 0, None
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn()) as bar:
        task = bar.add_task(f"train {method}", total=budget, info="")
        while (elapsed := time.perf_counter() - t0) < budget:
            frac = elapsed / budget
            for g in opt.param_groups:  # warm up 3%, then cosine to 10%
                g["lr"] = lr * min(1.0, frac / 0.03) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            idx = train_idx[torch.randint(len(train_idx), (batch_size,), generator=batcher.gen)]
            loss, acc = loss_and_acc(head, loaded, batcher.batch(idx), lm_weight)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step += 1
            ema = acc if ema is None else 0.95 * ema + 0.05 * acc
            info = f"step {step} loss {loss.item():.3f} acc@d " + " ".join(f"{a:.2f}" for a in ema.tolist())
            bar.update(task, completed=min(elapsed, budget), info=info)
    held_out = evaluate(head, loaded, eval_sets, lm_weight)
    output.parent.mkdir(parents=True, exist_ok=True)
    head.save(output)
    report = {"method": method, "steps": step, "seconds": round(time.perf_counter() - t0), "train_tokens": len(corpus.tokens),
              "held_out": held_out, "draft_vocab_coverage": round(coverage, 3), "output": str(output),
              "bytes": output.stat().st_size}
    print(report)
    return report
