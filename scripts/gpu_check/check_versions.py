"""Section 1: versions, the GPU, the optional packages, and graphshard's private-API probe."""

from __future__ import annotations

import importlib
import platform
import subprocess
import sys


def _version(name: str) -> str:
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        return f"no ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    return f"yes ({getattr(mod, '__version__', '?')})"


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "?"
    except (OSError, subprocess.TimeoutExpired):
        return "? (no nvidia-smi)"


def _nccl(torch) -> str:
    try:
        v = torch.cuda.nccl.version()
    except Exception as e:  # noqa: BLE001
        return f"? ({type(e).__name__})"
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def run(res, dry: bool) -> None:
    import torch
    import triton

    import graphshard

    rows = [["python", f"{sys.version.split()[0]} ({platform.platform()})"],
            ["torch", f"{torch.__version__} (CUDA {torch.version.cuda})"],
            ["triton", triton.__version__]]
    try:
        import transformers

        rows.append(["transformers", transformers.__version__])
    except Exception as e:  # noqa: BLE001
        rows.append(["transformers", f"not importable: {type(e).__name__}"])
    figs = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "triton": triton.__version__, "graphshard_path": graphshard.__file__}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        figs.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sm_count=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}", driver=_driver(),
                    nccl=_nccl(torch))
        rows += [["GPU", f"{p.name}, {figs['gpu_memory_gib']} GiB, {p.multi_processor_count} SMs, sm_{p.major}{p.minor}"],
                 ["driver / NCCL", f"{figs['driver']} / {figs['nccl']}"]]
    else:
        rows.append(["GPU", "none (CPU dry run)" if dry else "none"])
    for name in ("torchrec", "fbgemm_gpu"):
        figs[name] = _version(name)
        rows.append([name, figs[name]])
    if figs["fbgemm_gpu"].startswith("yes"):
        import fbgemm_gpu

        figs["fbgemm_variant"] = getattr(fbgemm_gpu, "__variant__", "?")  # cpu | cuda | rocm
        rows.append(["fbgemm_gpu variant", figs["fbgemm_variant"]])
    rows.append(["graphshard", graphshard.__file__])
    res.fig(**figs)
    res.table(["what", "version"], rows)

    probe = importlib.import_module("graphshard._api_probe")
    found = probe.probe_private_apis()
    missing = probe.missing_private_apis()  # what graphshard cannot do without
    gated = {k: v for k, v in probe.missing_private_apis(gated=True).items() if k not in missing}
    res.fig(probe={"checked": len(found), "missing": missing, "gated": gated})
    res.line(f"- private-API probe: {len(found)} APIs checked, {len(missing)} missing, {len(gated)} missing but "
             "gated (graphshard does without them)")
    for name, why in sorted({**missing, **gated}.items()):
        res.line(f"  - {'gated' if name in gated else 'missing'} `{name}`: {why}")
    res.check("every private torch API graphshard needs is present", not missing,
              ", ".join(sorted(missing)) if missing else "")
