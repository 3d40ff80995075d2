"""EAGLE / EAGLE-3 proposer: a one-layer head over the target's own features.

The head (``kiln.runtime.model.eagle``) pairs, at each position ``p``, the embedding of
token ``p + 1`` with the target's feature at ``p`` (EAGLE: the last hidden state; EAGLE-3:
the low/middle/high residual streams fused by ``fc``) and predicts token ``p + 2``.  Its KV
cache (one layer) has the target's block count and is written through the target's block
tables, like the draft model's.

Every target forward hands its features to ``on_target_features`` (the model runner's
``hidden_sink``); they wait per sequence until the next proposal, which runs the head over
the positions verified since the last one (catch-up, the target's features) and then
``k - 1`` steps on the head's own features.  Positions whose head KV was computed from the
head's own features are recomputed from the target's once verified, as vLLM's proposer does.
At most ``MAX_PENDING`` positions of features wait per sequence (older ones are dropped while
the batch is too large to speculate; the head then attends over stale KV there, which costs
acceptance, never correctness).  The target's decode graphs return the features too (EAGLE:
the graph's output; EAGLE-3: the residual streams kept as static graph outputs).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..core.sched_output import SchedulerOutput
from ..model.eagle import EagleHead, aux_layers, eagle_kind, read_head_config
from ..model.layers import set_kernel_options
from .draft import DraftModelProposer, last_drafts, read_back_drafts
from .eagle_graphs import EagleHeadGraphs

log = logging.getLogger(__name__)

MAX_PENDING = 512  # positions of target features kept per sequence (tokens)


class EagleProposer(DraftModelProposer):
    """Drafts from an EAGLE head.

    Args:
        k: drafts per sequence and step (tokens).
        head: the loaded :class:`EagleHead` (KV cache bound).
        target_runner: the target's ``ModelRunner`` (embedding, LM head, metadata helpers).
        graphs: the head's captured one-token steps (None: they run eagerly).
    """

    needs_model = True

    def __init__(self, k: int, head: EagleHead, target_runner, graphs: EagleHeadGraphs | None = None):
        self.k = k
        self.graphs = graphs  # the head's one-token steps as CUDA graphs (None: eager)
        self.head = head
        self.runner = target_runner
        self.block_size = target_runner.block_size
        self._state: dict[str, tuple[int, int]] = {}
        # request id -> (first position, features [n, F], num_preemptions) waiting for the head
        self._pending: dict[str, tuple[int, torch.Tensor, int]] = {}
        # the target's feature width: EAGLE the hidden size, EAGLE-3 three of them
        self.feature_dim = head.fc.weight.shape[1] - (head.fc.weight.shape[0] if head.kind == "eagle" else 0)
        target_runner.hidden_sink = self.on_target_features

    @classmethod
    def load(cls, config, target) -> "EagleProposer":
        """Load the head folder ``config.model`` (``config.json`` + ``*.safetensors`` or
        ``pytorch_model.bin``) beside the target.

        Raises:
            ValueError: not a folder with a config and weights; a head whose hidden size
                differs from the target's; a tensor the layout does not have; an EAGLE-3 head
                on a target of fewer than 7 layers (no three distinct layers to fuse).
        """
        folder = Path(config.model)
        if not (folder / "config.json").is_file():
            raise ValueError(f"speculative model {config.model}: an EAGLE head is a folder with config.json and "
                             "its weights (safetensors or pytorch_model.bin)")
        try:
            cfg, raw = read_head_config(folder)
        except ValueError as e:
            raise ValueError(f"speculative model {config.model}: the EAGLE head's {e}") from None
        try:
            weights = _read_tensors(folder)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001  (safetensors' and torch.load's errors have no common type)
            raise ValueError(f"speculative model {config.model}: the EAGLE head's weights cannot be read: "
                             f"{type(e).__name__}: {e}") from None
        kind = eagle_kind(weights)
        tcfg = target.model_config
        if cfg.hidden_size != tcfg.hidden_size:
            raise ValueError(f"speculative model {config.model}: hidden size {cfg.hidden_size}, the target's "
                             f"{tcfg.hidden_size}; the head was trained for another model")
        if kind == "eagle3":
            layers = aux_layers(tcfg.num_hidden_layers)
            if len(set(layers)) != len(layers) or not all(0 <= i < tcfg.num_hidden_layers for i in layers):
                raise ValueError(f"speculative model {config.model}: an EAGLE-3 head fuses the residual streams of "
                                 f"three distinct target layers {layers}; the target has only "
                                 f"{tcfg.num_hidden_layers} layers (at least 7 needed)")
        runner = target.runner
        head = EagleHead(cfg, kind, int(raw.get("draft_vocab_size") or tcfg.vocab_size), tcfg.vocab_size,
                         fc_bias="fc.bias" in weights, own_embedding="embed_tokens.weight" in weights
                         or "model.embed_tokens.weight" in weights)
        head = head.to(device=runner.device, dtype=runner.dtype)
        missing = {n for n, _ in head.named_parameters()} - head.load_weights(weights.items())
        if missing:
            raise ValueError(f"speculative model {config.model}: the {kind} checkpoint lacks {sorted(missing)[:3]}")
        shape = (runner.num_kv_blocks, runner.block_size, cfg.num_key_value_heads, cfg.head_dim)
        attn = head.self_attn.attn
        attn.k_cache = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
        attn.v_cache = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
        set_kernel_options(head, runner.kernel_options)
        if kind == "eagle3":
            runner.model.model.aux_layers = aux_layers(tcfg.num_hidden_layers)
            if runner.decode_graphs is not None:  # recapture: the graphs must keep the streams too
                runner.decode_graphs = None
                runner.capture_cuda_graphs(target.max_model_len)
        head = head.eval()
        graphs = None
        if runner.decode_graphs is not None and runner.decode_graphs.graphs:
            graphs = EagleHeadGraphs(head, runner, config.max_batch_size)
            graphs.capture()
        log.info("%s head %s loaded for speculative decoding (%d drafts per step)", kind, folder,
                 config.num_speculative_tokens)
        return cls(config.num_speculative_tokens, head, runner, graphs)

    # -- the target's features ----------------------------------------------------------------
    def on_target_features(self, ordered, hidden: torch.Tensor) -> None:
        """Keep each scheduled request's features of the rows it computed (model order)."""
        feats = self.runner.model.model.aux_hidden if self.head.kind == "eagle3" else hidden
        r = 0
        for sr in ordered:
            n = sr.num_new_tokens
            req = sr.request
            start = sr.num_computed_tokens
            old = self._pending.get(req.request_id)
            chunk = feats[r:r + n]
            if old is not None and old[2] == req.num_preemptions and old[0] + old[1].shape[0] == start:
                start, chunk = old[0], torch.cat([old[1], chunk])
            if chunk.shape[0] > MAX_PENDING:
                start, chunk = start + chunk.shape[0] - MAX_PENDING, chunk[-MAX_PENDING:]
            self._pending[req.request_id] = (start, chunk, req.num_preemptions)
            r += n

    def on_verified(self, out: SchedulerOutput, num_accepted: dict[str, int]) -> None:
        """Drop the features of rejected drafts (positions past the verified tokens)."""
        for sr in out.scheduled:
            p = self._pending.get(sr.request.request_id)
            if p is not None:
                keep = max(0, sr.request.num_computed_tokens - p[0])
                self._pending[sr.request.request_id] = (p[0], p[1][:keep], p[2])

    def free(self, request_id: str) -> None:
        self._state.pop(request_id, None)
        self._pending.pop(request_id, None)

    # -- proposing ----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, rows: dict) -> dict[str, torch.Tensor]:
        """Write every drafting sequence's drafts into its ``spec_token_ids`` (see the module
        docstring); returns the draft distributions of sampled sequences."""
        srs = [sr for sr in out.scheduled if sr.num_spec_tokens]
        if not srs:
            return {}
        bs = self.block_size
        ids, pos, feats, seq_lens, q_lens, tables = [], [], [], [], [], []
        for sr in srs:
            req, n = sr.request, sr.num_tokens
            start, f, npre = self._pending.get(req.request_id, (0, None, -1))
            if f is None or npre != req.num_preemptions or not f.shape[0] or start + f.shape[0] != n - 1:
                # no target features up to the last computed position (a prefix-cache hit
                # covered them): one row at the last position, on a zero feature
                start, f = n - 2, torch.zeros(1, self.feature_dim, dtype=self.runner.dtype, device=self.runner.device)
            ids += req.token_slice(start + 1, n)
            pos += range(start, n - 1)
            feats.append(f)
            seq_lens.append(n - 1)
            q_lens.append(n - 1 - start)
            tables.append(sr.block_ids)
        slots = [sr.block_ids[p // bs] * bs + p % bs for sr, ql, sl in zip(srs, q_lens, seq_lens)
                 for p in range(sl - ql, sl)]
        last = [sum(q_lens[: i + 1]) - 1 for i in range(len(srs))]
        logits, h = self._head_forward(ids, pos, torch.cat(feats), slots, seq_lens, q_lens, tables, last, True)
        probs: dict[str, list[torch.Tensor]] = {}
        # the drafts stay on the device (each step reads the last one there) and are read
        # back once, at the end
        cols = [(list(range(len(srs))), self._pick(logits, srs, rows, probs))]
        for j in range(1, max(sr.num_spec_tokens for sr in srs)):
            live = [i for i, sr in enumerate(srs) if sr.num_spec_tokens > j]
            sub = [srs[i] for i in live]
            prev = last_drafts(cols, live, self.runner)
            idx = self.runner.h2d(live, torch.int64) if len(live) != len(srs) else None
            feats = h if idx is None else h.index_select(0, idx)
            p = [sr.num_tokens + j - 2 for sr in sub]  # the position of the row that reads draft j
            tables = [sr.block_ids for sr in sub]
            stepped = self.graphs.run(prev, feats, p, tables) if self.graphs is not None else None
            if stepped is None:
                stepped = self._head_forward(prev, p, feats, [sr.block_ids[q // bs] * bs + q % bs
                                                              for sr, q in zip(sub, p)],
                                             [q + 1 for q in p], [1] * len(sub), tables, list(range(len(sub))), False)
            logits, hn = stepped
            h = hn if idx is None else h.index_copy(0, idx, hn)
            cols.append((live, self._pick(logits, sub, rows, probs)))
        read_back_drafts(cols, srs)
        for sr in srs:
            self._pending.pop(sr.request.request_id, None)
        return {rid: torch.stack(ps) for rid, ps in probs.items()}

    def _head_forward(self, ids, pos, feats, slots, seq_lens, q_lens, tables, logit_rows, fuse):
        """The head's eager forward over rows of token ``ids`` (a host list, or int64 on the
        device) at positions ``pos`` with features ``feats``: float32 logits and the next
        features of the rows ``logit_rows``."""
        r = self.runner
        num_decodes = len(q_lens) if all(q == 1 for q in q_lens) else 0
        meta = r.attention_metadata(slots, seq_lens, q_lens, tables, num_decodes)
        ids_t = ids if torch.is_tensor(ids) else r.h2d(ids, torch.int64)
        emb = self.head.embed_tokens(ids_t) if self.head.embed_tokens is not None else \
            r.model.model.embed_tokens(ids_t)
        for_logits, nxt = self.head(emb, feats, r.h2d(list(pos), torch.int64), meta, fuse)
        sel = r.h2d(logit_rows, torch.int64)
        return self.head.compute_logits(for_logits.index_select(0, sel), r.model.lm_head), nxt.index_select(0, sel)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a head folder (``*.safetensors``, else ``pytorch_model.bin``)."""
    files = sorted(folder.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file  # noqa: PLC0415

        for f in files:
            out.update(load_file(str(f)))
        return out
    bin_ = folder / "pytorch_model.bin"
    if not bin_.is_file():
        raise ValueError(f"speculative model {folder}: no *.safetensors or pytorch_model.bin")
    return torch.load(bin_, map_location="cpu", weights_only=True)
