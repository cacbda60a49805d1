"""What the indexer's benchmarks share: causal rows and torch.topk's sets of them, the benchmark
shape's logits inputs and product ceilings on the GPU, and the configs' names and texts (the
parent hands its configs to a child process as text), and device memory as the installed
allocator counts it."""

from __future__ import annotations

import dataclasses

import torch

from indexer import HopperConfig, LogitsConfig, TopkConfig
from indexer import topk as topk_mod

FP8 = torch.float8_e4m3fn
M, N, H, D, MM = 4096, 65536, 64, 128, 8192   # the benchmark shape; MM: the products' side


def causal_ends(m: int, n: int, device) -> torch.Tensor:
    """Causal rows: the m queries of a prefill spread evenly over the n keys, row i seeing the
    first (i + 1) * n / m of them (half the pairs of full rows)."""
    return ((torch.arange(m, device=device, dtype=torch.int64) + 1) * n // m).to(torch.int32)


def topk_rows(x: torch.Tensor, causal: bool):
    """(x, ks, ke) for full rows of x, or causal ones (``causal_ends``) with -inf past each
    row's end, so that torch.topk gets the same rows."""
    m, n = x.shape
    ks = torch.zeros(m, dtype=torch.int32, device=x.device)
    if not causal:
        return x, ks, torch.full((m,), n, dtype=torch.int32, device=x.device)
    ke = causal_ends(m, n, x.device)
    return x.masked_fill(torch.arange(n, device=x.device)[None, :] >= ke[:, None],
                         float("-inf")), ks, ke


def torch_topk_sets(x: torch.Tensor, ke: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk's index sets of the rows (ks = 0), sorted, as the kernel gives them: a row
    shorter than k has its -inf columns as -1."""
    theirs = torch.topk(x, k, dim=1, sorted=False).indices
    return torch.where(theirs < ke[:, None], theirs, -1).sort(1).values


def dtype_name(dtype) -> str:
    return {torch.bfloat16: "bf16", FP8: "fp8", torch.float32: "float32"}.get(dtype, str(dtype))


def topk_name(cfg: TopkConfig) -> str:
    layout = (f"stream seg {cfg.segment or 'auto'}" if cfg.stream
              else f"x{cfg.programs_per_sm}/SM")
    return (f"b{cfg.block}/{cfg.collect_block} cand {cfg.cand} s{cfg.stages} w{cfg.num_warps} "
            f"{layout}")


def topk_config_text(cfg: TopkConfig) -> str:
    """The --topk-config text that parse_topk_config turns back into cfg."""
    return ",".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg))


def logits_config_text(cfg) -> str:
    if isinstance(cfg, HopperConfig):
        return f"wgmma:{cfg.stages},{cfg.consumers},{cfg.linear_terms}"
    return f"{cfg.block_m},{cfg.block_n},{cfg.num_warps},{cfg.num_stages}"


def parse_logits_config(text):
    if not text:
        return None
    if text.startswith("wgmma:"):
        return HopperConfig(*(int(v) for v in text[len("wgmma:"):].split(",")))
    return LogitsConfig(*(int(v) for v in text.split(",")))


def parse_topk_config(text, k=2048):
    """``field=value,...`` over TopkConfig's fields; the rest come from default_config(k)."""
    if not text:
        return None
    defaults = topk_mod.default_config(k)
    fields = [f.name for f in dataclasses.fields(TopkConfig)]
    values = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if name not in fields or not value:
            raise SystemExit(f"--topk-config: expected field=value with field one of "
                             f"{', '.join(fields)}, got {item!r}")
        kind = type(getattr(defaults, name))
        if kind is bool:
            if value not in ("True", "False"):
                raise SystemExit(f"--topk-config: {name} takes True or False, got {value!r}")
            values[name] = value == "True"
        else:
            try:
                values[name] = kind(value)
            except ValueError:
                raise SystemExit(f"--topk-config: {name} takes a {kind.__name__}, "
                                 f"got {value!r}") from None
    return dataclasses.replace(defaults, **values)


def logits_inputs(dtype, h: int = H, seed: int = 0):
    """(q, kv, kv_scale, w, ks, ke) at the benchmark shape with ``h`` heads, full rows, on fresh
    random data (kv rows scaled into e4m3's range for fp8, as a quantizer would)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q32 = torch.randn(M, h, D, generator=g, device="cuda")
    kv32 = torch.randn(N, D, generator=g, device="cuda")
    w = torch.randn(M, h, generator=g, device="cuda") / h ** 0.5
    scale = torch.rand(N, generator=g, device="cuda") + 0.5
    if dtype == FP8:
        row = kv32.abs().amax(1).clamp(min=1e-6) / 448.0
        q, kv, scale = q32.to(FP8), (kv32 / row[:, None]).to(FP8), scale * row
    else:
        q, kv = q32.to(dtype), kv32.to(dtype)
    ks = torch.zeros(M, dtype=torch.int32, device="cuda")
    ke = torch.full((M,), N, dtype=torch.int32, device="cuda")
    return q, kv, scale.float(), w, ks, ke


def product_case(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(MM, MM, generator=g, device="cuda")
    b = torch.randn(MM, MM, generator=g, device="cuda")
    if dtype == FP8:
        a8, b8 = a.to(FP8), b.to(FP8).t()            # _scaled_mm wants b column-major
        one = torch.ones((), device="cuda")
        fn = lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,  # noqa: E731
                                      out_dtype=torch.bfloat16, use_fast_accum=True)
        return fn, 2 * MM ** 3, "torch._scaled_mm"
    a16, b16 = a.bfloat16(), b.bfloat16()
    return (lambda: a16 @ b16), 2 * MM ** 3, "torch.matmul"


def reset_memory(arena_installed: bool, smoke: bool) -> None:
    if smoke:
        return
    if arena_installed:
        import alloc
        alloc.reset_peak_memory_stats()
    else:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def memory(arena_installed: bool, smoke: bool) -> dict:
    if smoke:
        return {}
    free, total = torch.cuda.mem_get_info()
    if arena_installed:
        import alloc
        return dict(free=free, total=total, allocated=alloc.memory_allocated(),
                    peak_allocated=alloc.max_memory_allocated(),
                    reserved=alloc.memory_reserved(), peak_reserved=alloc.max_memory_reserved())
    return dict(free=free, total=total, allocated=torch.cuda.memory_allocated(),
                peak_allocated=torch.cuda.max_memory_allocated(),
                reserved=torch.cuda.memory_reserved(),
                peak_reserved=torch.cuda.max_memory_reserved())


def alloc_importable() -> bool:
    try:
        import alloc  # noqa: F401
    except ImportError:
        return False
    return True
