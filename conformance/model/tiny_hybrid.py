"""A tiny hybrid model: recurrent layers (short causal conv + gated delta rule)
interleaved with rotary attention layers, full (A) or sliding-window (W).

Two paths share the weights and the pure per-chunk pieces (projections, the
causal conv over a window, attention under a mask, the delta rule), and differ
in where their inputs come from:

- :meth:`TinyHybrid.reference` runs a whole sequence from scratch (a zero-padded
  causal conv, a full causal attention matrix, a zero initial state): the oracle.
- :meth:`TinyHybrid.step` computes tokens [start, end) given the attention KV of
  [0, start) and the recurrent states at ``start``; it returns the new KV to
  store and the updated states, and can capture the states at positions inside
  the chunk (for snapshots).  The harness's runner feeds it from paged memory.

On a CPU in float64 the two agree to ~1e-12.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    new_win: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per window layer: K, V


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


# Chunks of this many tokens or more take the delta rule's closed form; shorter
# ones (decode steps, short chunks) the token loop, cheaper below it
# (measured on the default model: 5 tokens 180 us vs 118 us, 3 tokens 101 vs 143).
CHUNK_FORM_FROM = 5


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
            if kind in ("A", "W"):  # a window layer is an attention layer with a mask
                hd = c.attn_heads * c.head_dim
                p |= {"wq": w(d, hd, std=d**-0.5), "wk": w(d, hd, std=d**-0.5),
                      "wv": w(d, hd, std=d**-0.5), "wo": w(hd, d, std=hd**-0.5)}
            else:
                ch = c.conv_channels
                p |= {"w_in": w(d, ch, std=d**-0.5), "conv": w(c.conv_width, ch, std=0.6),
                      "w_decay": w(d, c.rec_heads, std=d**-0.5), "b_decay": 2.0 + w(c.rec_heads, std=0.3),
                      "w_beta": w(d, c.rec_heads, std=d**-0.5),
                      "w_out": w(c.rec_heads * c.rec_value_dim, d, std=(c.rec_heads * c.rec_value_dim) ** -0.5)}
            # One matmul for the layer's input projections, not three (rows of
            # these tiny matrices cost Python's per-operation overhead, not flops).
            # (The weights are drawn one by one above, so the draws stay those of
            # the separate projections.)
            if kind in ("A", "W"):
                p["wqkv"] = torch.cat([p.pop("wq"), p.pop("wk"), p.pop("wv")], dim=1)
            else:
                p["w_rec"] = torch.cat([p.pop("w_in"), p.pop("w_decay"), p.pop("w_beta")], dim=1)
            self.layers.append(p)
        self.final_norm = 1.0 + w(d, std=0.1)
        self.lm_head = w(d, c.vocab_size, std=c.lm_head_scale * d**-0.5)
        half = c.head_dim // 2
        self._inv_freq = (1.0 / (c.rope_base ** (torch.arange(half, dtype=torch.float64) / half))).to(
            dtype=dtype, device=self.device)
        self._cos = self._sin = self._inv_freq.new_zeros(0, 1, 1, half)  # rotary table, grown on demand

    # -- a fresh recurrent state (what a "fresh" StateInit starts from) ---------------
    def zero_state(self) -> RecState:
        c = self.config
        return RecState(
            conv=torch.zeros(c.conv_width - 1, c.conv_channels, dtype=self.dtype, device=self.device),
            ssm=torch.zeros(c.rec_heads, c.rec_value_dim, c.rec_key_dim, dtype=self.dtype, device=self.device))

    # -- pieces shared by both paths (pure functions of their inputs) -----------------
    def _rotation(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the rotary angles at positions [start, end), [T, 1, 1, half],
        from a table computed once per length (every step asks for them)."""
        if end > self._cos.shape[0]:
            n = max(end, 2 * self._cos.shape[0])
            ang = torch.arange(n, device=self.device).to(self.dtype)[:, None] * self._inv_freq[None, :]
            self._cos, self._sin = ang.cos()[:, None, None, :], ang.sin()[:, None, None, :]
        return self._cos[start:end], self._sin[start:end]

    def _qkv(self, p: dict, x: torch.Tensor, start: int):
        c = self.config
        qkv = (x @ p["wqkv"]).view(x.shape[0], 3, c.attn_heads, c.head_dim)
        cos, sin = self._rotation(start, start + x.shape[0])
        half = c.head_dim // 2
        x1, x2 = qkv[:, :2, :, :half], qkv[:, :2, :, half:]  # q and k rotated together
        qk = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return qk[:, 0], qk[:, 1], qkv[:, 2]

    def _attend(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, start: int) -> torch.Tensor:
        """Attention of queries at positions [start, start + T) over keys [0, len(K)):
        query i sees keys [0, start + i].  Returns [T, heads * head_dim]."""
        t = q.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, K) / self.config.head_dim**0.5
        if t > 1 or K.shape[0] > start + 1:  # (one query at the end sees every key: no mask)
            sees = torch.arange(K.shape[0], device=self.device)[None, :] <= torch.arange(
                start, start + t, device=self.device)[:, None]
            scores = scores.masked_fill(~sees, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), V).reshape(t, -1)

    def _attend_window(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, start: int, first: int,
                       window: int) -> torch.Tensor:
        """Sliding-window attention of queries at positions [start, start + T)
        over keys at positions [first, first + len(K)): query at q sees the keys
        at [q - window + 1, q] (vLLM's ``sliding_window``).  Returns [T, heads * head_dim]."""
        t = q.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, K) / self.config.head_dim**0.5
        if t > 1 or first <= start - window:  # (one query whose keys are its window's exactly: no mask)
            kpos = torch.arange(first, first + K.shape[0], device=self.device)[None, :]
            qpos = torch.arange(start, start + t, device=self.device)[:, None]
            scores = scores.masked_fill(~((kpos <= qpos) & (kpos > qpos - window)), float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), V).reshape(t, -1)

    def _conv(self, p: dict, window: torch.Tensor) -> torch.Tensor:
        """The depthwise causal conv over ``window`` (the conv_width - 1 inputs
        before the chunk, then the chunk's): [T, ch].  Shifted products, what
        F.conv1d computes here bit for bit, at a sixth of its cost on these sizes."""
        rows = p["conv"].unbind(0)  # one call for the conv_width weight rows
        t = window.shape[0] - len(rows) + 1
        y = window[:t] * rows[0]
        for j in range(1, len(rows)):
            y = y + window[j: j + t] * rows[j]
        return y

    def _projections(self, p: dict, x: torch.Tensor):
        """The recurrent layer's conv input [T, ch], decay and beta [T, H]."""
        c = self.config
        u, dec, bet = (x @ p["w_rec"]).split_with_sizes([c.conv_channels, c.rec_heads, c.rec_heads], dim=-1)
        return u, torch.sigmoid(dec + p["b_decay"]), torch.sigmoid(bet)  # decay, beta in (0, 1)

    def _split_conv_out(self, y: torch.Tensor):
        c = self.config
        t = y.shape[0]
        y = F.silu(y).view(t, c.rec_heads, 2 * c.rec_key_dim + c.rec_value_dim)
        qk = torch.unflatten(y[..., : 2 * c.rec_key_dim], -1, (2, c.rec_key_dim))
        # F.normalize's arithmetic without its Python wrappers (Tensor.norm's)
        qk = qk / torch.linalg.vector_norm(qk, 2, -1, keepdim=True).clamp_min(1e-12)
        return qk[..., 0, :], qk[..., 1, :], y[..., 2 * c.rec_key_dim:]

    def _delta_rule(self, S: torch.Tensor, q, k, v, decay, beta, capture_rel: set[int], on_capture):
        """Gated delta rule over a chunk.  Returns outputs and the final state.

        Per token, per head: S <- decay*S; S <- S + beta*(v - S k) k^T; out = S q.
        A few tokens go token by token; a longer chunk in the closed form of
        :meth:`_delta_rule_chunk` (a constant number of tensor operations,
        not seven a token: Python's per-operation cost on these tiny tensors
        was most of the oracle's time).  Both agree with each other to ~1e-15
        (tests/test_model.py), far inside the float64 tolerance of 1e-9."""
        form = self._delta_rule_chunk if q.shape[0] >= CHUNK_FORM_FROM else self._delta_rule_loop
        return form(S, q, k, v, decay, beta, capture_rel, on_capture)

    @staticmethod
    def _delta_rule_loop(S: torch.Tensor, q, k, v, decay, beta, capture_rel: set[int], on_capture):
        """The recurrence token by token (seven arithmetic operations a token).
        The per-token operands are shaped once for the chunk, as views, so a token
        costs its arithmetic and plain row selections."""
        T, H = q.shape[0], q.shape[1]
        dec, bet = decay.view(T, H, 1, 1), beta.view(T, H, 1, 1)
        k_col, k_row = k.unsqueeze(-1), k.unsqueeze(-2)  # [T, H, K, 1], [T, H, 1, K]
        v_col, q_col = v.unsqueeze(-1), q.unsqueeze(-1)  # [T, H, V, 1], [T, H, K, 1]
        if T == 1:  # a decode token: the same arithmetic without the list, the stack and the squeeze
            # (about 0.1 ms of a 0.9 ms decode step over six layers, measured side by side)
            S = S * dec[0]
            S = S + bet[0] * ((v_col[0] - S @ k_col[0]) * k_row[0])
            if 1 in capture_rel:
                on_capture(1, S)
            return (S @ q_col[0]).view(1, H, -1), S
        outs = []
        for t in range(T):
            S = S * dec[t]
            S = S + bet[t] * ((v_col[t] - S @ k_col[t]) * k_row[t])
            outs.append(S @ q_col[t])
            if t + 1 in capture_rel:
                on_capture(t + 1, S)
        return torch.stack(outs).squeeze(-1), S

    @staticmethod
    def _delta_rule_chunk(S0: torch.Tensor, q, k, v, decay, beta, capture_rel: set[int], on_capture):
        """The same recurrence in closed form (the "WY" form of Yang et al.'s
        gated delta networks).  With g_t = sum_{j<=t} log decay_j, the state
        after token t is S_t = e^{g_t} S0 + sum_{i<=t} e^{g_t - g_i} w_i k_i^T,
        where w_i = beta_i (v_i - e^{g_i} S0 k_i - sum_{j<i} e^{g_i - g_j}
        (k_i . k_j) w_j): a unit lower-triangular system in the w's."""
        T = q.shape[0]
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, K|V]
        g = decay.log().transpose(0, 1).cumsum(-1)  # [H, T]
        pos = torch.arange(T, device=q.device)
        later = pos[None, :] > pos[:, None]  # [T, T]: j > i, masked before exp (it may overflow)
        ratio = (g[:, :, None] - g[:, None, :]).masked_fill(later, float("-inf")).exp()  # [H, T, T]
        gamma = g.exp()[:, :, None]  # [H, T, 1]
        bh = beta.transpose(0, 1)[:, :, None]  # [H, T, 1]
        S0t = S0.transpose(-1, -2)  # [H, K, V]
        # The unit lower-triangular matrix written out whole: the solver is told
        # so, but handed the raw product it rounds differently (by ~1e-15).
        system = (bh * (kh @ kh.transpose(-1, -2)) * ratio).tril(-1) + torch.eye(T, dtype=q.dtype, device=q.device)
        W = torch.linalg.solve_triangular(system, bh * (vh - gamma * (kh @ S0t)), upper=False, unitriangular=True)
        out = gamma * (qh @ S0t) + ((qh @ kh.transpose(-1, -2)) * ratio) @ W  # [H, T, V]

        def state_after(n: int) -> torch.Tensor:
            return gamma[:, n - 1, :, None] * S0 + (W[:, :n] * ratio[:, n - 1, :n, None]).transpose(-1, -2) @ kh[:, :n]

        for rel in sorted(capture_rel):
            on_capture(rel, state_after(rel))
        return out.transpose(0, 1), state_after(T)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return _rms_norm(h, self.final_norm) @ self.lm_head

    # -- the oracle: whole sequence, no cache --------------------------------------
    # (Both paths run under inference mode: without autograd's bookkeeping a
    # decode step costs about a third less; the arithmetic is the same.  What
    # they return is an inference tensor: copy it, as memory does, to modify
    # it outside.)
    @torch.inference_mode()
    def reference(self, tokens: list[int] | tuple[int, ...]) -> torch.Tensor:
        """Logits [len(tokens), vocab] of a from-scratch run."""
        c = self.config
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        n = ids.shape[0]
        h = self.embed[ids]
        for kind, width, p in zip(c.layer_kinds, c.layer_windows, self.layers):
            x = _rms_norm(h, p["norm"])
            if kind == "A":
                q, k, v = self._qkv(p, x, 0)
                h = h + self._attend(q, k, v, 0) @ p["wo"]
            elif kind == "W":
                q, k, v = self._qkv(p, x, 0)
                h = h + self._attend_window(q, k, v, 0, 0, width) @ p["wo"]
            else:
                u, decay, beta = self._projections(p, x)  # [n, ch], [n, H], [n, H]
                # The conv over zero left padding (a fresh state's conv part).
                y = self._conv(p, torch.cat([u.new_zeros(c.conv_width - 1, u.shape[1]), u]))
                q, k, v = self._split_conv_out(y)
                S0 = torch.zeros(c.rec_heads, c.rec_value_dim, c.rec_key_dim, dtype=self.dtype, device=self.device)
                o, _ = self._delta_rule(S0, q, k, v, decay, beta, set(), None)
                h = h + o.reshape(n, -1) @ p["w_out"]
        return self._head(h)

    # -- the cached path: a chunk on top of stored KV and states ---------------------
    @torch.inference_mode()
    def step(self, tokens: list[int] | tuple[int, ...], start: int,
             past_kv: list[tuple[torch.Tensor, torch.Tensor]], states: list[RecState],
             capture: tuple[int, ...] = (),
             past_win: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> StepOutput:
        """Compute positions [start, start+len(tokens)).

        ``past_kv[i]`` holds K and V of positions [0, start) for (full)
        attention layer i (as read from memory); ``states[j]`` the recurrent
        state at ``start`` for recurrent layer j; ``past_win[w]`` K and V of
        the last positions before ``start`` for window layer w (at least its
        window - 1 of them, or all from 0: what it reads ends at ``start``).
        ``capture`` lists absolute positions in (start, end] whose states are
        returned too.  The new K and V of window layers come back in
        ``StepOutput.new_win``.
        """
        c = self.config
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        t = ids.shape[0]
        capture_rel = {pos - start for pos in capture}
        captured: dict[int, list[RecState]] = {pos: [] for pos in capture}
        new_kv, new_states, new_win = [], [], []
        h = self.embed[ids]
        ai = ri = wi = 0
        for kind, width, p in zip(c.layer_kinds, c.layer_windows, self.layers):
            x = _rms_norm(h, p["norm"])
            if kind == "A":
                q, k, v = self._qkv(p, x, start)
                pk, pv = past_kv[ai]
                h = h + self._attend(q, torch.cat([pk, k]), torch.cat([pv, v]), start) @ p["wo"]
                new_kv.append((k, v))
                ai += 1
            elif kind == "W":
                q, k, v = self._qkv(p, x, start)
                assert past_win is not None, "a model with window layers needs past_win"
                pk, pv = past_win[wi]
                h = h + self._attend_window(q, torch.cat([pk, k]), torch.cat([pv, v]), start,
                                            start - pk.shape[0], width) @ p["wo"]
                new_win.append((k, v))
                wi += 1
            else:
                st = states[ri]
                u, decay, beta = self._projections(p, x)
                window = torch.cat([st.conv, u])  # [W-1+t, ch]
                w_ = c.conv_width
                q, k, v = self._split_conv_out(self._conv(p, window))

                def on_capture(rel: int, S: torch.Tensor, window=window, w_=w_) -> None:
                    captured[start + rel].append(RecState(conv=window[rel: rel + w_ - 1].clone(), ssm=S.clone()))

                o, S = self._delta_rule(st.ssm, q, k, v, decay, beta, capture_rel, on_capture)
                new_states.append(RecState(conv=window[t: t + w_ - 1].clone(), ssm=S))
                h = h + o.reshape(t, -1) @ p["w_out"]
                ri += 1
        return StepOutput(logits=self._head(h), new_kv=new_kv, states=new_states, captured=captured,
                          new_win=new_win)
