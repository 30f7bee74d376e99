"""The eight CPU `sgl_kernel` ops SGLang 0.5.23's speculative path calls on `--device cpu`,
in torch, put on the `sgl_kernel` stand-in (every other op of it still raises when called).

PyPI has no CPU build of `sgl-kernel`; SGLang imports these at module level when `is_cpu()`:
`copy_all_layer_kv_cache_cpu` (`kernels/ops/kvcache/cache_move.py:10`, at start-up whenever
speculation is on), `build_tree_kernel_efficient_cpu` and `verify_tree_greedy_cpu`
(`kernels/ops/speculative/spec_tree.py:39-43`), `assign_draft_cache_locs_contiguous_cpu` and
`assign_extend_cache_locs_cpu` (`kernels/ops/speculative/cache_locs.py:27-31`),
`fill_accept_out_cache_loc_cpu` and `fill_bonus_tokens_cpu` (`kernels/ops/speculative/eagle.py:10`),
`assign_req_to_token_pool_cpu` (`srt/mem_cache/allocation.py:46`).  Each follows the Triton
kernel of the same file, which `check_spec_kernels.py` (run by `tests/test_sglang_spec.py`)
runs beside it in Triton's interpreter.  The two tree walks loop per request in Python: only
for tiny models.
"""

from __future__ import annotations

import ctypes

import torch


def _runs(
    requests: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The req_to_token cells (row, column) of each request's run [start, end), packed in
    order: the one layout the two ops below scatter into and gather from."""
    lengths = (ends - starts).clamp(min=0).to(torch.int64)
    owner = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    columns = starts.to(torch.int64)[owner] + torch.arange(int(lengths.sum())) - first[owner]
    return requests.to(torch.int64)[owner], columns


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_i, start_i:end_i] = the i-th run of out_cache_loc (Triton:
    `allocation.py` `assign_req_to_token_pool`)."""
    rows, columns = _runs(req_pool_indices, start_offset, end_offset)
    req_to_token[rows, columns] = out_cache_loc[: rows.numel()].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """The inverse gather: out_cache_loc packs req_to_token[req_i, start_i:end_i] (Triton:
    `cache_locs.py` `assign_extend_cache_locs`)."""
    rows, columns = _runs(req_pool_indices, start_offset, end_offset)
    out_cache_loc[: rows.numel()] = req_to_token[rows, columns].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_cols: int,
) -> None:
    """Row i of out_cache_loc: req_to_token[req_i, seq_len_i : seq_len_i + topk * num_cols]
    (Triton: `cache_locs.py` `assign_draft_cache_locs_contiguous`)."""
    width = topk * num_cols
    columns = seq_lens.to(torch.int64)[:, None] + torch.arange(width)
    rows = req_pool_indices.to(torch.int64)[:, None]
    gathered = req_to_token[rows, columns].reshape(-1)
    out_cache_loc[: gathered.numel()] = gathered.to(out_cache_loc.dtype)


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """Each request's last accepted token (Triton: `eagle.py` `fill_bonus_tokens`)."""
    last = accept_stride * torch.arange(accept_lens.numel()) + accept_lens.to(torch.int64) - 1
    bonus_tokens[: last.numel()] = accept_tokens.reshape(-1)[last].to(bonus_tokens.dtype)


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """out_cache_loc at every accepted index (not -1), packed in order (Triton: `eagle.py`
    `fill_accept_out_cache_loc`)."""
    flat = accept_index.reshape(-1).to(torch.int64)
    accepted = out_cache_loc[flat[flat > -1]]
    accept_out_cache_loc[: accepted.numel()] = accepted.to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """In every per-layer buffer (base address, row bytes) copy row src[i] to row tgt[i];
    every source is read before any target is written, as in the tiled Triton kernel
    (`cache_move.py` `copy_all_layer_kv_cache_tiled`, "safe for in-place copy")."""
    if tgt_loc.numel() == 0:
        return
    src, tgt = src_loc.to(torch.int64), tgt_loc.to(torch.int64)
    rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for base, row_bytes in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        span = (ctypes.c_uint8 * (rows * int(row_bytes))).from_address(int(base))
        layer = torch.frombuffer(span, dtype=torch.uint8).view(rows, int(row_bytes))
        layer[tgt] = layer[src]  # the right side is gathered into a new tensor first


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """The draft tree of each request: positions, the retrieve links, and the attention mask
    in FULL_MASK (0) or QLEN_ONLY (1) layout (Triton: `spec_tree.py`
    `sgl_build_tree_kernel_efficient_triton`; bit-packed masks are not ported)."""
    mode = int(tree_mask_mode)
    if mode not in (0, 1):
        raise NotImplementedError(f"tree mask mode {mode}: only FULL_MASK and QLEN_ONLY")
    n = draft_token_num
    batch = verified_seq_len.numel()
    if batch == 0:
        return
    # a one-step chain has no parent entries: (batch, 0), which reshape(batch, -1) refuses
    parents = parent_list.reshape(batch, parent_list.numel() // batch).tolist()
    chosen = selected_index.reshape(batch, n - 1).tolist()
    mask = tree_mask.reshape(-1)
    pos, index = positions.reshape(-1), retrieve_index.reshape(-1)
    next_token = retrieve_next_token.reshape(-1)
    next_sibling = retrieve_next_sibling.reshape(-1)
    seq_lens = [int(s) for s in verified_seq_len.tolist()]
    for b, seq_len in enumerate(seq_lens):
        sel, par = chosen[b], parents[b]

        def parent_of(i: int, sel: list[int] = sel, par: list[int] = par) -> int | None:
            """Where draft i's parent sits among the selected tokens (-1: the root)."""
            parent = sel[i] // topk
            if parent == 0:
                return -1
            found = [j for j in range(n - 1) if sel[j] == par[parent]]
            return found[0] if found else None

        nxt = next_token[b * n : (b + 1) * n].tolist()
        sib = next_sibling[b * n : (b + 1) * n].tolist()
        pos[b * n] = seq_len
        index[b * n] = b * n
        for i in range(n - 1, 0, -1):
            index[b * n + i] = b * n + i
            parent = parent_of(i - 1)
            if parent is not None:
                old = nxt[parent + 1]
                nxt[parent + 1] = i
                if old != -1:
                    sib[i] = old
        next_token[b * n : (b + 1) * n] = torch.tensor(nxt, dtype=next_token.dtype)
        next_sibling[b * n : (b + 1) * n] = torch.tensor(sib, dtype=next_sibling.dtype)
        base = n * n * b + sum(seq_lens[:b]) * n
        for x in range(n):
            row = base + (seq_len + n) * x + seq_len + 1 if mode == 0 else n * n * b + n * x + 1
            mask[row - 1] = True
            mask[row : row + n - 1] = False
            if x == 0:
                continue
            cur, depth_of_x = x - 1, 0
            for _ in range(depth):
                depth_of_x += 1
                mask[row + cur] = True
                parent = parent_of(cur)
                if parent is None or parent == -1:
                    break
                cur = parent
            pos[b * n + x] = seq_len + depth_of_x


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy acceptance down each request's tree: a draft is accepted while it equals the
    target's own prediction at its parent (Triton: `spec_tree.py`
    `verify_tree_greedy_kernel_triton`; the keyword names are the op's, spelling included)."""
    batch, _ = candidates.shape
    steps = accept_index.shape[1]
    cand, index = candidates.tolist(), retrive_index.tolist()
    nxt, sib = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    out = predicts.reshape(-1)
    for b in range(batch):
        last = index[b][0]
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            cur = nxt[b][cur]
            while cur != -1 and cand[b][cur] != target[last]:
                cur = sib[b][cur]
            if cur == -1:
                break
            out[last] = target[last]
            accepted += 1
            accept_index[b, accepted] = index[b][cur]
            last = index[b][cur]
        accept_token_num[b] = accepted
        out[last] = target[last]


OPS = {
    op.__name__: op
    for op in (
        assign_req_to_token_pool_cpu,
        assign_extend_cache_locs_cpu,
        assign_draft_cache_locs_contiguous_cpu,
        fill_bonus_tokens_cpu,
        fill_accept_out_cache_loc_cpu,
        copy_all_layer_kv_cache_cpu,
        build_tree_kernel_efficient_cpu,
        verify_tree_greedy_cpu,
    )
}
