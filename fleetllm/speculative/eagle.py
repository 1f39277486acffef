"""EAGLE and P-EAGLE: a one-layer draft head over the target's own hidden states.

The head reads, for each context position j, the target's token t_{j+1} (through the target's frozen
embedding) and a feature f_j fused from three target layers (low, middle, high); one decoder layer with
causal attention over a short window of such slots, then the target's frozen LM head restricted to a
reduced draft vocabulary. The last context slot holds the last sampled token and the real feature of
the position before it; its output predicts the first draft token.

- ``eagle`` drafts autoregressively: draft d becomes the next slot's token, the head's own output the
  next slot's feature (with a KV cache over the window, so each extra draft costs one slot).
- ``peagle`` drafts all K tokens in ONE forward: slots 2..K hold a learned mask-token embedding and a
  learned mask feature at positions anchor+1 .. anchor+K-1; causal attention lets each see the context.

Both are deterministic (argmax), so :mod:`fleetllm.speculative.verify` keeps the output distribution exact.
Weights: ``fleetllm/speculative/heads/<target>-<method>.safetensors`` (trained by ``fleetllm spec train``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from fleetllm.engine.sequence import Sequence
from fleetllm.models.llama import LlamaModel, Rotary, _rotate_half
from fleetllm.speculative.drafter import register

HEADS_DIR = Path(__file__).parent / "heads"


@dataclass
class HeadConfig:
    method: str  # eagle | peagle
    target: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    aux_layers: tuple[int, ...]
    draft_vocab_size: int
    window: int = 8  # context slots the head attends over
    max_depth: int = 6  # drafts it was trained for
    rms_norm_eps: float = 1e-5

    @classmethod
    def for_target(cls, target: LlamaModel, method: str, name: str, **kw: object) -> HeadConfig:
        c = target.cfg
        n = c.num_layers
        return cls(
            method=method, target=name, hidden_size=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim, intermediate_size=c.intermediate_size // 2, aux_layers=(2, n // 2, n - 3),
            draft_vocab_size=min(8192, c.vocab_size), rms_norm_eps=c.rms_norm_eps, **kw,  # type: ignore[arg-type]
        )


class DraftHead(nn.Module):
    """The trainable part; the embedding, LM head and RoPE tables are the target's (passed in, frozen)."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.fuse = nn.Linear(len(cfg.aux_layers) * h, h, bias=False)  # three target layers -> one feature
        self.tok_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.feat_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.attn_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.qkv = nn.Linear(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, bias=False)
        self.o = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.out_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.mask_embed = nn.Parameter(torch.zeros(h))  # P-EAGLE: token slot of positions 2..K
        self.mask_feature = nn.Parameter(torch.zeros(h))  # P-EAGLE: feature slot of positions 2..K
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size), persistent=True)

    def forward(
        self,
        tok_emb: torch.Tensor,  # [B, L, H] token embeddings (target embedding, or mask_embed)
        feats: torch.Tensor,  # [B, L, H] fused target features, head outputs, or mask_feature
        positions: torch.Tensor,  # [B, L]
        rotary: Rotary,
        key_mask: torch.Tensor | None = None,  # [B, Lpast+L] False where a key is padding
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        c = self.cfg
        b, n, _ = tok_emb.shape
        x = self.tok_norm(tok_emb) + self.feat_norm(feats)
        q, k, v = self.qkv(self.attn_norm(x)).split(
            [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], dim=-1
        )
        q = q.view(b, n, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos = rotary.cos[positions].unsqueeze(1).to(q.dtype)  # [B, 1, L, D]
        sin = rotary.sin[positions].unsqueeze(1).to(q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        lk = k.shape[2]
        causal = torch.ones(n, lk, dtype=torch.bool, device=x.device).tril(lk - n)
        mask = causal.unsqueeze(0).unsqueeze(0)
        if key_mask is not None:
            mask = mask & key_mask[:, None, None, :]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        h = x + self.o(attn.transpose(1, 2).reshape(b, n, -1))
        gate, up = self.gate_up(self.mlp_norm(h)).split(c.intermediate_size, dim=-1)
        h = h + self.down(F.silu(gate) * up)
        return h, (k, v)

    def logits(self, h: torch.Tensor, lm_weight: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits; ``lm_weight`` is the target LM head's rows for ``draft_to_target``."""
        return F.linear(self.out_norm(h), lm_weight)

    def save(self, path: Path) -> None:
        tensors = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
                   for k, v in self.state_dict().items()}
        meta = asdict(self.cfg)
        meta["aux_layers"] = list(meta["aux_layers"])
        save_file(tensors, str(path), metadata={"config": json.dumps(meta)})

    @classmethod
    def load(cls, path: Path, device: str = "cpu") -> DraftHead:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["config"])
        meta["aux_layers"] = tuple(meta["aux_layers"])
        head = cls(HeadConfig(**meta))
        sd = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
        head.load_state_dict(sd)
        return head.to(device).eval().requires_grad_(False)


def head_path(target: str, method: str) -> Path:
    return HEADS_DIR / f"{target}-{method}.safetensors"


class HeadDrafter:
    """Shared plumbing: per-request window of fused features, batched context slots, the LM head subset.
    A subclass says how K drafts come out of the head (``_draft``)."""

    method = "eagle"
    one_pass = True

    def __init__(self, loaded, head: str | None = None, device: str = "cpu", **_: object) -> None:
        path = Path(head) if head else head_path(loaded.name, self.method)
        if not path.exists():
            raise FileNotFoundError(f"no {self.method} head for {loaded.name!r} at {path} (train one: fleetllm spec train)")
        self.head = DraftHead.load(path, device)
        self.target = loaded.model
        self.cfg = self.head.cfg
        self.aux_layers = self.cfg.aux_layers
        self.lm_weight = self.target.lm_head.weight[self.head.draft_to_target].detach().clone()
        self.features: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (first position, [n, H])

    @torch.inference_mode()
    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        w = self.cfg.window
        keep = features[-w:]
        fused = self.head.fuse(keep.float())
        end = start + len(features)
        old = self.features.get(seq.request_id)
        if old is not None and len(keep) < w and old[0] <= start <= old[0] + len(old[1]):
            # keep the older positions; those from ``start`` on are recomputed (rejected drafts, preemption)
            fused = torch.cat([old[1][: start - old[0]], fused])[-w:]
        self.features[seq.request_id] = (end - len(fused), fused)

    def forget(self, seq: Sequence) -> None:
        self.features.pop(seq.request_id, None)

    def _context(self, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded context slots of the sequences that have features: (rows, tok_emb, feats, pos, key_mask)."""
        rows, toks, feats, pos = [], [], [], []
        for i, seq in enumerate(seqs):
            got = self.features.get(seq.request_id)
            e = seq.num_computed_tokens  # features exist for positions < e; token t_e is the last sampled
            if got is None or got[0] + len(got[1]) != e:
                continue
            first, f = got
            tokens = seq.token_ids_slice(first + 1, e + 1)
            rows.append(i)
            toks.append(tokens)
            feats.append(f)
            pos.append(list(range(first + 1, e + 1)))
        if not rows:
            return rows, *(torch.empty(0),) * 4  # type: ignore[return-value]
        n = max(len(t) for t in toks)
        dev = self.lm_weight.device
        ids = torch.zeros(len(rows), n, dtype=torch.long)
        f_t = torch.zeros(len(rows), n, self.cfg.hidden_size, device=dev)
        p_t = torch.zeros(len(rows), n, dtype=torch.long)
        key_mask = torch.zeros(len(rows), n, dtype=torch.bool)
        for r, (t, f, p) in enumerate(zip(toks, feats, pos, strict=True)):
            m = len(t)
            ids[r, n - m :] = torch.tensor(t)
            f_t[r, n - m :] = f
            p_t[r, n - m :] = torch.tensor(p)
            key_mask[r, n - m :] = True
        emb = self.target.embed(ids.to(dev))
        return rows, emb, f_t, p_t.to(dev), key_mask.to(dev)

    def _active(self, seqs: list[Sequence], ks: list[int]) -> tuple | None:
        """The context rows of the sequences that want drafts (``ks[r] > 0``) and the depth to draft to."""
        rows, emb, feats, pos, key_mask = self._context(seqs)
        sel = [i for i, r in enumerate(rows) if ks[r] > 0]
        rows = [rows[i] for i in sel]
        if not rows:
            return None
        k = min(max(ks[r] for r in rows), self.cfg.max_depth)
        return rows, emb[sel], feats[sel], pos[sel], key_mask[sel], k

    def _argmax(self, h: torch.Tensor) -> torch.Tensor:
        return self.head.draft_to_target[self.head.logits(h, self.lm_weight).argmax(dim=-1)]

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        active = self._active(seqs, ks)
        if active is None:
            return out
        rows, emb, feats, pos, key_mask, k = active
        toks = self._draft(emb, feats, pos, key_mask, k).tolist()  # [rows, k] target token ids
        for j, r in enumerate(rows):
            out[r] = toks[j][: ks[r]]
        return out

    def _draft(self, emb, feats, pos, key_mask, k: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
        raise NotImplementedError


@register("eagle")
class EagleDrafter(HeadDrafter):
    method, one_pass = "eagle", False

    def _draft(self, emb, feats, pos, key_mask, k: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
        h, past = self.head(emb, feats, pos, self.target.rotary, key_mask)
        h = h[:, -1:]
        last_pos = pos[:, -1:]
        drafts = []
        for d in range(k):
            tok = self._argmax(h[:, -1])
            drafts.append(tok)
            if d == k - 1:
                break
            key_mask = torch.cat([key_mask, torch.ones_like(key_mask[:, :1])], dim=1)
            h, past = self.head(self.target.embed(tok).unsqueeze(1), h, last_pos + d + 1, self.target.rotary, key_mask, past)
        return torch.stack(drafts, dim=1)


@register("peagle")
class PEagleDrafter(HeadDrafter):
    method, one_pass = "peagle", True

    def _draft(self, emb, feats, pos, key_mask, k: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
        b, m = emb.shape[0], k - 1
        emb = torch.cat([emb, self.head.mask_embed.expand(b, m, -1)], dim=1)
        feats = torch.cat([feats, self.head.mask_feature.expand(b, m, -1)], dim=1)
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, m + 1, device=pos.device)], dim=1)
        key_mask = torch.cat([key_mask, torch.ones(b, m, dtype=torch.bool, device=key_mask.device)], dim=1)
        h, _ = self.head(emb, feats, pos, self.target.rotary, key_mask)
        return self._argmax(h[:, -k:])
