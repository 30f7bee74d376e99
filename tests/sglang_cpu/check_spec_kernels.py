"""Each port in spec_kernels.py beside SGLang 0.5.23's own Triton kernel for the same op, run
in Triton's interpreter on this CPU, on random inputs; prints one line per case and exits 1 on
any difference.

    TRITON_INTERPRET=1 SGLANG_USE_CPU_ENGINE=1 SHMSLOTS_SGLANG_CPU=1 \\
        PYTHONPATH=tests/sglang_cpu/site python tests/sglang_cpu/check_spec_kernels.py

(`tests/test_sglang_spec.py` runs it so.)  The Triton kernels are SGLang's, imported from its
modules and launched with the grid and arguments its own non-CPU wrappers use.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable

import torch
from sglang.kernels.ops.kvcache import cache_move
from sglang.kernels.ops.speculative import cache_locs, eagle, spec_tree
from sglang.srt.mem_cache import allocation
from sglang.srt.utils import next_power_of_2
from triton.runtime import interpreter  # type: ignore[import-untyped]

from sglang_cpu import spec_kernels as ports

Tensors = tuple[torch.Tensor, ...]
failures: list[str] = []
_patch_tensor = interpreter._patch_lang_tensor


def _patch_tensor_numpy2(tensor: object, scope: interpreter._LangPatchScope) -> None:
    """Triton 3.6's interpreter takes a loop bound as `int()` of a one-element array, which
    NumPy 2.4 refuses ("only 0-dimensional arrays can be converted"); `.item()` is the same
    number.  Without it, no kernel with a loaded loop bound runs in the interpreter."""
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


interpreter._patch_lang_tensor = _patch_tensor_numpy2


def same(name: str, ported: Tensors, triton: Tensors) -> None:
    ok = all(torch.equal(a, b) for a, b in zip(ported, triton, strict=True))
    print(f"{name}: {'same' if ok else 'DIFFERENT'}")
    if not ok:
        failures.append(name)


def twice(make: Callable[[], Tensors], port: Callable[[Tensors], None],
          kernel: Callable[[Tensors], None]) -> tuple[Tensors, Tensors]:  # fmt: skip
    """The outputs of the port and of the kernel, each on its own copy of the inputs."""
    a, b = make(), make()
    port(a)
    kernel(b)
    return a, b


def token_table(rng: random.Random, requests: int, width: int) -> torch.Tensor:
    return torch.tensor(
        [[rng.randrange(1, 10_000) for _ in range(width)] for _ in range(requests)],
        dtype=torch.int32,
    )


def runs(rng: random.Random, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.tensor([rng.randrange(0, width // 2) for _ in range(batch)])
    ends = starts + torch.tensor([rng.randrange(0, width // 2) for _ in range(batch)])
    return starts, ends


def check_cache_locs(rng: random.Random, batch: int) -> None:
    width, table = 64, token_table(rng, 12, 64)
    requests = torch.tensor(rng.sample(range(12), batch))
    starts, ends = runs(rng, batch, width)
    total = int((ends - starts).sum())
    upper = next_power_of_2(batch)

    def gather() -> Tensors:
        return (table.clone(), torch.full((total + 3,), -1, dtype=torch.int64))

    a, b = twice(
        gather,
        lambda t: ports.assign_extend_cache_locs_cpu(requests, t[0], starts, ends, t[1], width),
        lambda t: cache_locs.assign_extend_cache_locs[(batch,)](
            requests, t[0], starts, ends, t[1], width, upper
        ),
    )
    same(f"assign_extend_cache_locs batch {batch}", a, b)

    locs = torch.arange(100, 100 + total, dtype=torch.int64)
    a, b = twice(
        lambda: (table.clone(),),
        lambda t: ports.assign_req_to_token_pool_cpu(requests, t[0], starts, ends, locs, width),
        lambda t: allocation.assign_req_to_token_pool[(batch,)](
            requests, t[0], starts, ends, locs, width, upper
        ),
    )
    same(f"assign_req_to_token_pool batch {batch}", a, b)

    topk, steps = rng.choice([(1, 2), (1, 3), (4, 3)])
    seq_lens = torch.tensor([rng.randrange(0, width - topk * steps) for _ in range(batch)])
    a, b = twice(
        lambda: (torch.full((batch * topk * steps,), -1, dtype=torch.int64),),
        lambda t: ports.assign_draft_cache_locs_contiguous_cpu(
            requests, table, seq_lens, t[0], width, topk, steps
        ),
        lambda t: cache_locs.assign_draft_cache_locs_contiguous[(batch,)](
            requests, table, seq_lens, t[0], width, topk, steps, BS=batch
        ),
    )
    same(f"assign_draft_cache_locs_contiguous batch {batch} topk {topk} steps {steps}", a, b)


def check_eagle(rng: random.Random, batch: int) -> None:
    stride = rng.choice([2, 3, 4])
    tokens = torch.randint(0, 1000, (batch, stride))
    lens = torch.tensor([rng.randrange(1, stride + 1) for _ in range(batch)], dtype=torch.int32)
    a, b = twice(
        lambda: (torch.zeros(batch, dtype=torch.int64),),
        lambda t: ports.fill_bonus_tokens_cpu(tokens, lens, t[0], stride),
        lambda t: eagle.fill_bonus_tokens[(batch,)](tokens, lens, t[0], stride),
    )
    same(f"fill_bonus_tokens batch {batch}", a, b)

    size = batch * stride
    index = torch.tensor([rng.choice([-1, rng.randrange(size)]) for _ in range(size)])
    locs = torch.randint(0, 10_000, (size,))
    a, b = twice(
        lambda: (torch.full((size,), -7, dtype=torch.int64),),
        lambda t: ports.fill_accept_out_cache_loc_cpu(index, locs, t[0]),
        lambda t: eagle.fill_accept_out_cache_loc[(size,)](
            index, locs, t[0], next_power_of_2(size)
        ),
    )
    same(f"fill_accept_out_cache_loc size {size}", a, b)


def check_kv_copy(rng: random.Random, count: int) -> None:
    layers = [torch.randn(40, 2, 8) for _ in range(3)]
    tgt = torch.tensor(rng.sample(range(40), count))
    src = torch.tensor(rng.sample(range(40), count))  # may overlap tgt: in-place safety counts

    def make() -> Tensors:
        return tuple(layer.clone() for layer in layers)

    def pointers(t: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor([x.data_ptr() for x in t], dtype=torch.uint64),
                torch.tensor([x[0].nbytes for x in t], dtype=torch.int64))  # fmt: skip

    tile = 64
    a, b = twice(
        make,
        lambda t: ports.copy_all_layer_kv_cache_cpu(*pointers(t), tgt, src),
        lambda t: cache_move.copy_all_layer_kv_cache_tiled[(len(t), -(-t[0][0].nbytes // tile))](
            *pointers(t), tgt, src, count, next_power_of_2(count), BYTES_PER_TILE=tile
        ),
    )
    same(f"copy_all_layer_kv_cache {count} rows", a, b)


def eagle_tree(rng: random.Random, batch: int, topk: int, steps: int, n: int) -> Tensors:
    """Random parent lists and sorted selections of the shape EAGLE's draft makes."""
    if steps == 1:  # a one-step chain: no parent entries, every draft a child of the root
        parents = torch.zeros((batch, 0), dtype=torch.int64)  # `base_spec_worker.py:143`
        chosen = torch.arange(n - 1).repeat(batch, 1)
    else:
        width = topk * (steps - 1) + 1
        scores = topk * width
        parents = torch.tensor(
            [[-1] + [rng.randrange(scores) for _ in range(width - 1)] for _ in range(batch)]
        )
        chosen = torch.tensor([sorted(rng.sample(range(scores), n - 1)) for _ in range(batch)])
    seq_lens = torch.tensor([rng.randrange(3, 9) for _ in range(batch)])
    return parents, chosen, seq_lens


def check_tree(rng: random.Random, batch: int, topk: int, steps: int, n: int, mode: int) -> None:
    parents, chosen, seq_lens = eagle_tree(rng, batch, topk, steps, n)
    mask_len = n * n * batch if mode == 1 else int(seq_lens.sum()) * n + n * n * batch

    def make() -> Tensors:
        return (torch.zeros(mask_len, dtype=torch.bool), torch.zeros(batch * n, dtype=torch.int64),
                *(torch.full((batch, n), -1, dtype=torch.int64) for _ in range(3)))  # fmt: skip

    def port(t: Tensors) -> None:
        mask, positions, index, next_token, next_sibling = t
        ports.build_tree_kernel_efficient_cpu(
            parents, chosen, seq_lens, mask, positions, index, next_token, next_sibling,
            topk, steps, n, mode,
        )  # fmt: skip

    def kernel(t: Tensors) -> None:
        spec_tree.sgl_build_tree_kernel_triton(parents, chosen, seq_lens, *t, topk, steps, n, mode)

    a, b = twice(make, port, kernel)
    case = f"batch {batch} topk {topk} steps {steps} drafts {n} mask mode {mode}"
    same(f"build_tree_kernel_efficient {case}", a, b)

    _, _, index, next_token, next_sibling = a
    candidates = torch.randint(0, 4, (batch, n))
    target = torch.randint(0, 4, (batch, n))
    for row in range(batch):  # mostly agreeing drafts, so acceptance runs deep
        for i in range(n):
            child = int(next_token[row, i])
            if child != -1 and rng.random() < 0.8:
                target[row, i] = candidates[row, child]

    def outputs() -> Tensors:
        return (torch.zeros(batch * n, dtype=torch.int32),
                torch.full((batch, steps + 1), -1, dtype=torch.int32),
                torch.zeros(batch, dtype=torch.int32))  # fmt: skip

    links = (candidates, index, next_token, next_sibling, target)
    a, b = twice(
        outputs,
        lambda t: ports.verify_tree_greedy_cpu(t[0], t[1], t[2], *links),
        lambda t: spec_tree.verify_tree_greedy_triton(*t, *links),
    )
    same(f"verify_tree_greedy {case}", a, b)


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    rng = random.Random(0)
    torch.manual_seed(0)
    for batch in (1, 3, 5):
        check_cache_locs(rng, batch)
        check_eagle(rng, batch)
    for count in (1, 5, 17):
        check_kv_copy(rng, count)
    trees = [(1, 1, 2, 3, 1), (3, 1, 3, 4, 1), (2, 1, 2, 3, 0),  # batch, topk, steps, drafts,
             (2, 2, 3, 5, 1), (3, 4, 3, 8, 1), (2, 4, 3, 8, 0),  # mask mode
             (2, 1, 1, 2, 1), (0, 1, 2, 3, 1)]  # a one-step chain; an empty batch  # fmt: skip
    for tree in trees:
        check_tree(rng, *tree)
    print("all same" if not failures else f"{len(failures)} DIFFERENT")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
