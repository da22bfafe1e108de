"""A tiny hybrid model: recurrent layers (short causal conv + gated delta rule)
interleaved with rotary attention layers.

Two independent paths share only the weights:

- :meth:`TinyHybrid.reference` runs a whole sequence from scratch (a padded
  conv1d, a full causal attention matrix, a zero initial state): the oracle.
- :meth:`TinyHybrid.step` computes tokens [start, end) given the attention KV of
  [0, start) and the recurrent states at ``start``; it returns the new KV to
  store and the updated states, and can capture the states at positions inside
  the chunk (for snapshots).  The harness's runner feeds it from paged memory.

On a CPU in float64 the two agree to ~1e-12.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from conformance.model.config import ModelConfig


@dataclass
class RecState:
    conv: torch.Tensor  # [conv_width - 1, conv_channels]: the last inputs to the conv
    ssm: torch.Tensor  # [heads, value_dim, key_dim]


@dataclass
class StepOutput:
    logits: torch.Tensor  # [end - start, vocab]
    new_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per attention layer: K, V [end-start, H, D]
    states: list[RecState]  # per recurrent layer, at ``end``
    captured: dict[int, list[RecState]]  # absolute position -> per recurrent layer


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class TinyHybrid:
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float64, device: str = "cpu"):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(config.seed)
        c = config
        s = c.init_scale

        def w(*shape: int, std: float) -> torch.Tensor:
            t = torch.randn(*shape, generator=gen, dtype=torch.float64) * std * s
            return t.to(dtype=dtype, device=self.device)

        d = c.hidden
        self.embed = w(c.vocab_size, d, std=1.0)
        self.layers: list[dict[str, torch.Tensor]] = []
        for kind in c.layer_kinds:
            p = {"norm": 1.0 + w(d, std=0.1)}
            if kind == "A":
                hd = c.attn_heads * c.head_dim
                p |= {"wq": w(d, hd, std=d**-0.5), "wk": w(d, hd, std=d**-0.5),
                      "wv": w(d, hd, std=d**-0.5), "wo": w(hd, d, std=hd**-0.5)}
            else:
                ch = c.conv_channels
                p |= {"w_in": w(d, ch, std=d**-0.5), "conv": w(c.conv_width, ch, std=0.6),
                      "w_decay": w(d, c.rec_heads, std=d**-0.5), "b_decay": 2.0 + w(c.rec_heads, std=0.3),
                      "w_beta": w(d, c.rec_heads, std=d**-0.5),
                      "w_out": w(c.rec_heads * c.rec_value_dim, d, std=(c.rec_heads * c.rec_value_dim) ** -0.5)}
            self.layers.append(p)
        self.final_norm = 1.0 + w(d, std=0.1)
        self.lm_head = w(d, c.vocab_size, std=c.lm_head_scale * d**-0.5)
        half = c.head_dim // 2
        self._inv_freq = (1.0 / (c.rope_base ** (torch.arange(half, dtype=torch.float64) / half))).to(
            dtype=dtype, device=self.device)

    # -- a fresh recurrent state (what a "fresh" StateInit starts from) ---------------
    def zero_state(self) -> RecState:
        c = self.config
        return RecState(
            conv=torch.zeros(c.conv_width - 1, c.conv_channels, dtype=self.dtype, device=self.device),
            ssm=torch.zeros(c.rec_heads, c.rec_value_dim, c.rec_key_dim, dtype=self.dtype, device=self.device))

    # -- pieces shared by both paths (pure functions of their inputs) -----------------
    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ang = positions.to(self.dtype)[:, None] * self._inv_freq[None, :]  # [T, half]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def _qkv(self, p: dict, x: torch.Tensor, positions: torch.Tensor):
        c = self.config
        t = x.shape[0]
        q = (x @ p["wq"]).view(t, c.attn_heads, c.head_dim)
        k = (x @ p["wk"]).view(t, c.attn_heads, c.head_dim)
        v = (x @ p["wv"]).view(t, c.attn_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _split_conv_out(self, y: torch.Tensor):
        c = self.config
        t = y.shape[0]
        y = F.silu(y).view(t, c.rec_heads, 2 * c.rec_key_dim + c.rec_value_dim)
        q, k, v = y.split([c.rec_key_dim, c.rec_key_dim, c.rec_value_dim], dim=-1)
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1), v

    def _gates(self, p: dict, x: torch.Tensor):
        decay = torch.sigmoid(x @ p["w_decay"] + p["b_decay"])  # [T, H] in (0, 1)
        beta = torch.sigmoid(x @ p["w_beta"])  # [T, H]
        return decay, beta

    def _delta_rule(self, S: torch.Tensor, q, k, v, decay, beta, capture_rel: set[int], on_capture):
        """Gated delta rule, token by token.  Returns outputs and the final state.

        Per token, per head: S <- decay*S; S <- S + beta*(v - S k) k^T; out = S q.
        Written with matmul and broadcasting over views shaped once, not
        einsum: the same products and sums (bit for bit, tests/test_model.py),
        in about 40% of the time (einsum parses its equation on every call, and
        this loop is most of the oracle's and the cached path's time)."""
        outs = []
        d, b = decay[:, :, None, None], beta[:, :, None, None]  # [T, H, 1, 1]
        k_col, k_row = k[:, :, :, None], k[:, :, None, :]  # [T, H, K, 1], [T, H, 1, K]
        q_col, v_col = q[:, :, :, None], v[:, :, :, None]  # [T, H, K, 1], [T, H, V, 1]
        for t in range(q.shape[0]):
            S = S * d[t]
            v_old = S @ k_col[t]  # [H, V, 1]
            S = S + b[t] * ((v_col[t] - v_old) * k_row[t])
            outs.append(S @ q_col[t])
            if t + 1 in capture_rel:
                on_capture(t + 1, S)
        return torch.stack(outs)[..., 0], S

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return _rms_norm(h, self.final_norm) @ self.lm_head

    # -- the oracle: whole sequence, no cache --------------------------------------
    @torch.no_grad()
    def reference(self, tokens: list[int] | tuple[int, ...]) -> torch.Tensor:
        """Logits [len(tokens), vocab] of a from-scratch run."""
        c = self.config
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        n = ids.shape[0]
        positions = torch.arange(n, device=self.device)
        h = self.embed[ids]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        for kind, p in zip(c.layer_kinds, self.layers):
            x = _rms_norm(h, p["norm"])
            if kind == "A":
                q, k, v = self._qkv(p, x, positions)
                scores = torch.einsum("qhd,khd->hqk", q, k) / c.head_dim**0.5
                scores = scores.masked_fill(~causal, float("-inf"))
                o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
                h = h + o @ p["wo"]
            else:
                u = x @ p["w_in"]  # [n, ch]
                # Depthwise causal conv as conv1d over zero left padding.
                y = F.conv1d(F.pad(u.T[None], (c.conv_width - 1, 0)),
                             p["conv"].T[:, None, :], groups=u.shape[1])[0].T
                q, k, v = self._split_conv_out(y)
                decay, beta = self._gates(p, x)
                S0 = torch.zeros(c.rec_heads, c.rec_value_dim, c.rec_key_dim, dtype=self.dtype, device=self.device)
                o, _ = self._delta_rule(S0, q, k, v, decay, beta, set(), None)
                h = h + o.reshape(n, -1) @ p["w_out"]
        return self._head(h)

    # -- the cached path: a chunk on top of stored KV and states ---------------------
    @torch.no_grad()
    def step(self, tokens: list[int] | tuple[int, ...], start: int,
             past_kv: list[tuple[torch.Tensor, torch.Tensor]], states: list[RecState],
             capture: tuple[int, ...] = ()) -> StepOutput:
        """Compute positions [start, start+len(tokens)).

        ``past_kv[i]`` holds K and V of positions [0, start) for attention layer i
        (as read from memory); ``states[j]`` the recurrent state at ``start`` for
        recurrent layer j.  ``capture`` lists absolute positions in
        (start, end] whose states are returned too.
        """
        c = self.config
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        t = ids.shape[0]
        positions = torch.arange(start, start + t, device=self.device)
        capture_rel = {pos - start for pos in capture}
        captured: dict[int, list[RecState]] = {pos: [] for pos in capture}
        new_kv, new_states = [], []
        h = self.embed[ids]
        ai = ri = 0
        for kind, p in zip(c.layer_kinds, self.layers):
            x = _rms_norm(h, p["norm"])
            if kind == "A":
                q, k, v = self._qkv(p, x, positions)
                pk, pv = past_kv[ai]
                K, V = torch.cat([pk, k]), torch.cat([pv, v])
                outs = []
                for i in range(t):  # query i sees keys [0, start + i]
                    n_keys = start + i + 1
                    sc = torch.einsum("hd,khd->hk", q[i], K[:n_keys]) / c.head_dim**0.5
                    outs.append(torch.einsum("hk,khd->hd", sc.softmax(-1), V[:n_keys]))
                h = h + torch.stack(outs).reshape(t, -1) @ p["wo"]
                new_kv.append((k, v))
                ai += 1
            else:
                st = states[ri]
                u = x @ p["w_in"]
                window = torch.cat([st.conv, u])  # [W-1+t, ch]
                w_ = c.conv_width
                y = cast(torch.Tensor, sum(window[j: j + t] * p["conv"][j] for j in range(w_)))
                q, k, v = self._split_conv_out(y)
                decay, beta = self._gates(p, x)

                def on_capture(rel: int, S: torch.Tensor, window=window, w_=w_) -> None:
                    captured[start + rel].append(RecState(conv=window[rel: rel + w_ - 1].clone(), ssm=S.clone()))

                o, S = self._delta_rule(st.ssm, q, k, v, decay, beta, capture_rel, on_capture)
                new_states.append(RecState(conv=window[t: t + w_ - 1].clone(), ssm=S))
                h = h + o.reshape(t, -1) @ p["w_out"]
                ri += 1
        return StepOutput(logits=self._head(h), new_kv=new_kv, states=new_states, captured=captured)
