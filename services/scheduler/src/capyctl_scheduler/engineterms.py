"""What a vLLM or SGLang engine holds on its GPU as it starts and while it is parked, in the
engines' own terms, for a first start whose peak nobody declared or measured yet.

Each engine is told a budget B (`Footprint.engine_budget`: the declared request, or weights x
1.10 + KV cache) as a share, rounded up to a hundredth (`told_share`): vLLM's
--gpu-memory-utilization is a share of the whole card, SGLang's --mem-fraction-static a share
of the memory free when it starts. What it holds beyond B is fixed by its own code, read there:

vLLM (`vllm/v1/worker/gpu_worker.py`: `Worker.init_device`, `determine_available_memory`,
`compile_or_warm_up_model`; `vllm/utils/mem_utils.py`: `memory_profiling`,
`MemoryProfilingResult`; `vllm/config/vllm.py`: `_set_cudagraph_sizes`)
- It asks for the told share of the card's total (`vllm/v1/worker/utils.py`: `request_memory`,
  total_memory x gpu_memory_utilization) and refuses to start unless that much is free; it
  snapshots the device only once its CUDA context exists: the context sits outside B.
- Its profile run (one batch of max_num_batched_tokens) measures the weights, the activation
  peak and the memory outside torch; the KV cache is what remains of B. All of it is in B.
- From 0.21 (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS on, its default) the CUDA graphs are
  profiled too and taken out of the KV cache; before 0.21, or with that variable 0, they are
  captured after the KV cache, on top of B. Graphs are captured up to min(2 x max_num_seqs,
  512, max_num_batched_tokens) sequences, none with --enforce-eager.
- Given --kv-cache-memory-bytes (a deployment's `memory.kv_cache`) it skips the profiling and
  "does not respect gpu_memory_utilization": it holds weights, the profile run's activations,
  that KV cache and its graphs, whatever B says.
- Margin: the 150 MiB it leaves itself because "memory profiling may slightly underestimate
  the memory consumption" (`redundancy_buffer_memory`).

SGLang (`python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py`:
`profile_max_num_token`, `init_memory_pool`; `model_runner.py`: `init_torch_distributed`;
`python/sglang/srt/server_args.py`: `ServerArgs._handle_gpu_memory_settings`)
- Its static part, weights and KV cache, is the fraction of the memory free when it starts:
  `init_torch_distributed` reads `get_available_gpu_memory` (torch's free memory) once its
  CUDA context exists, before the weights load, and `profile_max_num_token` gives the KV cache
  what is left of fraction x that free memory ("Not enough memory" when nothing is). So it is
  told B as a share of what the ledger leaves free on its GPU as it starts, less its context:
  it holds B, and at most a hundredth of that free memory (so of the card) more for the
  rounding. Activations and CUDA graphs run outside it.
- Where it picks the fraction itself it sizes what runs outside as 1.5 MiB per token of one
  chunked prefill (at least 2048 tokens), 2 MiB per sequence of its largest captured graph
  (cuda_graph_max_bs), 512 MiB of constant metadata and 1/8 GiB per GPU of the model; on a
  card over 60 GiB never less than 10 GiB. Those are its terms here, metadata, parallel
  share and floor its margin. Its chunked prefill and graph sizes default by the card's size.

vLLM states no size per token or per graph (it measures them): where its activations or
graphs fall outside B, SGLang's figures stand for them, which agree with vLLM's own warning
that "CUDA graphs can take additional 1~3 GiB memory per GPU".

llama.cpp has no profiling run: it allocates weights, its context's KV cache and its compute
buffers once, as it loads, so its start is charged its ready footprint.

Both charges also hold the CUDA context: 612 MiB, measured on the H200 (issue 37). Besides
these figures, admission always keeps each card's free reserve (max(1 GiB, 8%)) unused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from capycommon.deployments import Resolved
from capycommon.engines.families import Family

MiB = 1 << 20
GiB = 1 << 30

CUDA_CONTEXT = 612 * MiB  # a process's CUDA context, measured on the H200 (issue 37)
VLLM_PROFILER_SLACK = 150 * MiB  # vLLM's redundancy buffer
VLLM_GRAPHS_IN_BUDGET_FROM = Version("0.21")
VLLM_GRAPH_ESTIMATE = "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"
SGLANG_PER_PREFILL_TOKEN = 3 * MiB // 2
SGLANG_MIN_PREFILL_TOKENS = 2048
SGLANG_PER_GRAPH_BATCH = 2 * MiB
SGLANG_METADATA = 512 * MiB
SGLANG_PER_GPU = GiB // 8  # tp_size x pp_size / 8 GiB; CapyCTL runs a model on one GPU
SGLANG_BIG_CARD = 60 * GiB
SGLANG_BIG_CARD_FLOOR = 10 * GiB
SGLANG_MAX_PREFILL_TOKENS = 16384  # its --max-prefill-tokens, used when chunking is off
# A count read from an engine flag is used only in 1..this (the longest context a deployment
# may give); anything else the engine refuses itself, and the estimate takes its default.
MOST_TOKENS = 16_777_216


@dataclass(frozen=True)
class EngineTerms:
    """What one launch holds on its device beside its budget, by its engine's own rules.

    `activations` are one batch's (vLLM: max_num_batched_tokens; SGLang: a chunked prefill),
    `graphs` its CUDA graphs; `*_inside` says whether its engine keeps them within the
    budget; `kv_fixed`: vLLM told its KV cache's size, which then ignores the budget."""

    family: Family
    activations: int
    graphs: int
    activations_inside: bool
    graphs_inside: bool
    kv_fixed: bool
    margin: int
    # What a park leaves on the device beside the CUDA context.
    parked_keeps: int

    def startup_peak(self, weights: int, kv_cache: int, budget: int, capacity: int) -> int:
        """The device bytes the engine reaches by the end of its start on a card of
        `capacity`: the CUDA context, the budget it is told (vLLM: its share of the card,
        rounded up as `told_fraction` rounds it; SGLang: its share of the memory free at its
        start, at most a hundredth of the card above the budget), or with a fixed KV cache
        weights + activations + that KV cache when more, what it keeps beside the budget, and
        its margin. llama.cpp: nothing beyond its ready charge."""
        if self.family == Family.LLAMACPP:
            return 0
        if self.family == Family.SGLANG:
            static = budget + capacity // 100
        else:
            static = int(told_fraction(budget, capacity) * capacity)
        if self.kv_fixed:
            static = max(static, weights + kv_cache + self.activations)
        beside = 0 if self.activations_inside or self.kv_fixed else self.activations
        beside += 0 if self.graphs_inside and not self.kv_fixed else self.graphs
        return CUDA_CONTEXT + static + beside + self.margin

    def parked_residue(self) -> int:
        """What a parked engine still holds on its device: its CUDA context, and what its park
        does not release. vLLM's sleep releases only weights and KV cache (the tags of its
        CuMemAllocator): its CUDA graph pool stays ("cudagraph memory pool is not released,
        and there are some other cost such as cuda context", vLLM PR 11743 and
        `tests/basic_correctness/test_cumem.py`). SGLang's release frees weights, KV cache and
        CUDA graphs (the tags CapyCTL resumes) and keeps its constant metadata."""
        return CUDA_CONTEXT + self.parked_keeps


def told_fraction(budget: int, whole: int) -> float:
    """The share of `whole` an engine is told it may take for `budget`: rounded up to a
    hundredth, at most 0.95."""
    return min(0.95, -(-budget * 100 // whole) / 100)


def told_share(family: Family, budget: int, capacity: int, free: int) -> float:
    """The fraction a launch tells its engine for `budget` on a card of `capacity` bytes, of
    which `free` is expected free as it starts (the card less what the ledger charges the
    others there, and its own LMCache server): vLLM's --gpu-memory-utilization is a share of
    the whole card; SGLang's --mem-fraction-static a share of what is free once its CUDA
    context exists."""
    if family == Family.SGLANG:
        return told_fraction(budget, max(free - CUDA_CONTEXT, budget, 1))
    return told_fraction(budget, capacity)


def terms_of(resolved: Resolved, capacity: int) -> EngineTerms:
    """The terms of `resolved` launched on a card of `capacity` bytes: its family's rules,
    the settings it passes (`engine_config`, `extra_args`, `env`) and its engine's defaults."""
    family = resolved.profile.family
    if family == Family.VLLM:
        return _vllm(resolved, capacity)
    if family == Family.SGLANG:
        return _sglang(resolved.extra_args, capacity)
    return EngineTerms(
        family,
        activations=0,
        graphs=0,
        activations_inside=True,
        graphs_inside=True,
        kv_fixed=False,
        margin=0,
        parked_keeps=0,
    )


def _vllm(resolved: Resolved, capacity: int) -> EngineTerms:
    """vLLM's terms. Its OpenAI server's defaults on a card of 70 GiB or more (an A100 aside,
    which the card's size cannot tell apart: the larger figures stand) are 8192 batched tokens
    and 1024 sequences, else 2048 and 256 (`EngineArgs.get_batch_defaults`)."""
    args = resolved.extra_args
    config = resolved.deployment.engine_config
    big = capacity >= 70 * GiB
    tokens = _count(args, "--max-num-batched-tokens") or (8192 if big else 2048)
    sequences = config.max_concurrent_requests or (1024 if big else 256)
    captured = min(2 * sequences, 512, tokens)
    stated = _counts(args, "--cuda-graph-sizes")
    if stated:
        captured = min(max(stated), tokens)
    captured = min(_count(args, "--max-cudagraph-capture-size") or captured, tokens)
    if _switch(args, "--enforce-eager"):
        captured = 0
    graphs = captured * SGLANG_PER_GRAPH_BATCH
    return EngineTerms(
        Family.VLLM,
        activations=tokens * SGLANG_PER_PREFILL_TOKEN,
        graphs=graphs,
        activations_inside=True,
        graphs_inside=_graphs_in_budget(resolved.profile.version, config.env),
        kv_fixed=config.memory.kv_cache is not None,
        margin=VLLM_PROFILER_SLACK,
        parked_keeps=graphs,
    )


def _sglang(args: Sequence[str], capacity: int) -> EngineTerms:
    """SGLang's terms, its defaults by the card's size as `_handle_gpu_memory_settings` picks
    them (one GPU: cuda_graph_max_bs for a tensor-parallel size under 4)."""
    mib = capacity // MiB
    chunk, batch = _sglang_defaults(mib)
    chunk = _signed(args, "--chunked-prefill-size", chunk)
    if chunk <= 0:  # chunking off: one prefill of --max-prefill-tokens
        chunk = _count(args, "--max-prefill-tokens") or SGLANG_MAX_PREFILL_TOKENS
    batch = max(_counts(args, "--cuda-graph-bs") or [_count(args, "--cuda-graph-max-bs") or batch])
    if _switch(args, "--disable-cuda-graph"):
        batch = 0
    activations = max(chunk, SGLANG_MIN_PREFILL_TOKENS) * SGLANG_PER_PREFILL_TOKEN
    graphs = batch * SGLANG_PER_GRAPH_BATCH
    margin = SGLANG_METADATA + SGLANG_PER_GPU
    if capacity > SGLANG_BIG_CARD:
        margin = max(margin, SGLANG_BIG_CARD_FLOOR - activations - graphs)
    return EngineTerms(
        Family.SGLANG,
        activations=activations,
        graphs=graphs,
        activations_inside=False,
        graphs_inside=False,
        kv_fixed=False,
        margin=margin,
        parked_keeps=SGLANG_METADATA,
    )


def _sglang_defaults(mib: int) -> tuple[int, int]:
    """SGLang's chunked prefill size and cuda_graph_max_bs for a card of `mib` MiB."""
    if mib < 20 * 1024:
        return 2048, 8
    if mib < 35 * 1024:
        return 2048, 24
    if mib < 60 * 1024:
        return 4096, 32
    if mib < 160 * 1024:
        return 8192, 256
    return 16384, 512


def _graphs_in_budget(version: str, env: Mapping[str, str]) -> bool:
    """Whether vLLM sizes its KV cache after its CUDA graphs: from 0.21, unless its variable
    says 0 (read as vLLM reads it, an integer). A version it cannot read counts as older."""
    try:
        profiled = Version(version) >= VLLM_GRAPHS_IN_BUDGET_FROM
    except InvalidVersion:
        return False
    return profiled and env.get(VLLM_GRAPH_ESTIMATE, "1").strip() != "0"


def _values(args: Sequence[str], flag: str) -> list[str] | None:
    """The values of the last `flag` in `args` (`--flag v`, `--flag v w`, `--flag=v`), as an
    argument parser keeps the last; None when `flag` is not given."""
    found: list[str] | None = None
    for index, arg in enumerate(args):
        if arg.startswith(flag + "="):
            found = [arg.partition("=")[2]]
        elif arg == flag:
            rest = args[index + 1 :]
            end = next((i for i, a in enumerate(rest) if a.startswith("-") and a != "-1"), None)
            found = list(rest[:end])
    return found


def _counts(args: Sequence[str], flag: str) -> list[int]:
    """The whole numbers in 1..MOST_TOKENS the last `flag` gives (a list flag may give
    several, separated by spaces or commas)."""
    values = _values(args, flag) or []
    words = [word for value in values for part in value.split(",") for word in part.split()]
    return [n for n in (_whole(word) for word in words) if n is not None and n > 0]


def _count(args: Sequence[str], flag: str) -> int | None:
    values = _values(args, flag)
    found = _whole(values[0]) if values and len(values) == 1 else None
    return found if found is not None and found > 0 else None


def _signed(args: Sequence[str], flag: str, default: int) -> int:
    """A count that may be -1 (SGLang's chunked prefill off); the default when absent or
    not a whole number in -1..MOST_TOKENS."""
    values = _values(args, flag)
    found = _whole(values[0]) if values and len(values) == 1 else None
    return default if found is None else found


def _whole(word: str) -> int | None:
    text = word.strip()
    digits = text.removeprefix("-")
    if not digits.isascii() or not digits.isdigit() or len(digits) > 9:
        return None
    value = int(text)
    return value if -1 <= value <= MOST_TOKENS else None


def _switch(args: Sequence[str], flag: str) -> bool:
    """A boolean flag as argparse reads it, the last word winning: `--flag`, or `--no-flag`
    (vLLM's BooleanOptionalAction)."""
    negated = "--no-" + flag.removeprefix("--")
    found = False
    for arg in args:
        if arg == flag:
            found = True
        elif arg == negated:
            found = False
    return found
