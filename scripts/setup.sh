#!/usr/bin/env bash
# Installs what graphshard needs, idempotently: torch (>= 2.11; 2.13.0 CPU build here, required),
# graphshard itself (editable, from this checkout) and, where it can, the optional pieces: the test
# tools (pytest, expecttest), transformers 5.24.0 (the model-coverage suite), on torch 2.13 CPU builds
# TorchRec with fbgemm's CPU build, and Triton (on CPU builds the newest, 3.9; a CUDA build keeps the
# Triton it came with). Safe to run on every invocation.
#
# Fast when all is there: one Python process checks everything (package metadata, no imports of
# torch or graphshard) and pip is not called. Works without a package index (an offline GPU
# machine): the index is probed once, with pip itself (so the user's index-url, extra-index-url,
# find-links and no-index settings count), with no retries and a short timeout; if nothing is
# reachable each optional piece is skipped with one line on stderr,
#   setup: skipped <piece> (<why>); <what that disables>
# and graphshard's editable install is built with the environment's own setuptools (no network).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

TORCH_PIN=2.13.0                     # what setup installs when torch >= 2.11 is missing
TRANSFORMERS_PIN=5.24.0              # the model-coverage suite's transformers
TRITON_PIN=3.9.0                     # CPU builds: the newest Triton (its interpreter runs the TBE kernels);
                                     # a CUDA build's Triton is torch's own requirement (3.6 on the GPU machine)
# TorchRec, optional (the sparse frontend, graphshard.model_parallel), on torch 2.13 CPU builds only:
# fbgemm-gpu-cpu 1.8.0 (the fbgemm build that loads with it) and torchrec 1.9.2 installed without
# pip's resolver (torchrec requires the CUDA fbgemm-gpu), then what torchrec imports.
TORCHREC_NODEPS="fbgemm-gpu-cpu==1.8.0 torchrec==1.9.2"
TORCHREC_DEPS="tensordict==0.15.3 torchmetrics==1.0.3 pyre-extensions==0.0.32"
PROBE_TIMEOUT=20                     # seconds, the whole index probe (DNS included)
PIP_OFFLINE_OPTS=(--retries 0 --timeout 10)   # optional installs: fail in seconds, not 180 s x 5

# Prints one line per missing piece: "torch <found|none>", "test <missing modules>",
# "transformers <found|->", "torchrec", "triton <found|->", "graphshard". Mode "graphshard": only
# torch and graphshard. Imports nothing heavy (torch only where it has no package metadata).
check() {
  # shellcheck disable=SC2086
  "$PY" - "$PWD" "$1" "$TRANSFORMERS_PIN" "$TRITON_PIN" $TORCHREC_NODEPS $TORCHREC_DEPS <<'CHECK'
import importlib.metadata as md, importlib.util, os, sys
repo, mode, transformers_pin, triton_pin, *torchrec_pins = sys.argv[1:]
repo = os.path.realpath(repo)
# graphshard must come from its installation, not from the current directory (this checkout)
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != repo]


def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def module_version(module):
    v = version(module)
    if v is None and importlib.util.find_spec(module) is not None:  # importable without metadata
        try:
            v = str(__import__(module).__version__)
        except Exception:
            v = None
    return v


def minor(v):
    try:
        return tuple(int(x) for x in v.split("+")[0].split(".")[:2])
    except (AttributeError, ValueError):
        return (0, 0)


def locate(name):
    """The spec `import name` would use, found without importing (so without importing torch)."""
    parent = name.rpartition(".")[0]
    path = locate(parent).submodule_search_locations if parent else None
    for finder in sys.meta_path:
        spec = finder.find_spec(name, path) if hasattr(finder, "find_spec") else None
        if spec is not None:
            return spec
    raise ModuleNotFoundError(name)


def torch_triton():
    """The Triton version a CUDA build of torch requires (its ``triton==X`` requirement), if any."""
    try:
        requires = md.requires("torch") or ()
    except md.PackageNotFoundError:  # no torch yet (a fresh machine): setup installs the pinned build
        return None
    for req in requires:
        name, _, rest = req.partition("==")
        if name.strip() in ("triton", "pytorch-triton") and rest:
            return rest.split(";")[0].strip()
    return None


def graphshard_installed():
    """Importable from THIS checkout (passes/ and kernels/ ship inside it) with its backend entry point."""
    try:
        for module, folder in (("graphshard", "graphshard"), ("graphshard.passes", "passes"),
                               ("graphshard.kernels", "kernels")):
            if os.path.realpath(os.path.dirname(locate(module).origin)) != os.path.join(repo, folder):
                return False
        return any(e.name == "graphshard" for e in md.entry_points(group="torch_dynamo_backends"))
    except Exception:
        return False


missing = []
torch = module_version("torch")
if torch is None or minor(torch) < (2, 11):
    missing.append(f"torch {torch or 'none'}")
if mode == "all":
    test = [m for m in ("pytest", "expecttest") if importlib.util.find_spec(m) is None]
    if test:
        missing.append("test " + " ".join(test))
    transformers = version("transformers")
    if transformers != transformers_pin:
        missing.append(f"transformers {transformers or '-'}")
    pins = dict(p.split("==") for p in torchrec_pins)
    if (torch or "").startswith("2.13.") and "+cpu" in torch and any(version(p) != v for p, v in pins.items()):
        missing.append("torchrec")
    triton = module_version("triton")
    cpu_build = "+cpu" in (torch or "")
    if triton is None or (cpu_build and minor(triton) != minor(triton_pin)):
        missing.append(f"triton {triton or '-'} {triton_pin if cpu_build else torch_triton() or triton_pin}")
if not graphshard_installed():
    missing.append("graphshard")
print("\n".join(missing))
CHECK
}

parse() {  # sets need_* from check's output
  need_torch="" torch_have="" need_test="" test_missing="" need_transformers="" transformers_have=""
  need_torchrec="" need_triton="" triton_have="" triton_want="" need_graphshard=""
  while read -r piece rest; do
    case $piece in
      torch) need_torch=1 torch_have=$rest ;;
      test) need_test=1 test_missing=$rest ;;
      transformers) need_transformers=1 transformers_have=$rest ;;
      torchrec) need_torchrec=1 ;;
      triton) need_triton=1 triton_have=${rest% *} triton_want=${rest##* } ;;
      graphshard) need_graphshard=1 ;;
    esac
  done <<<"$1"
}

if ! missing=$(check all); then
  echo "setup: $PY could not run the installation check (is it a Python >= 3.10?)" >&2
  exit 1
fi
[ -n "$missing" ] || exit 0   # everything is there: no pip at all
parse "$missing"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

die() { echo "$*" >&2; exit 1; }
skip() { echo "setup: skipped $1 ($2); $3" >&2; }
bounded() {  # bounded SECONDS CMD...: CMD, killed after SECONDS where coreutils' timeout exists
  if command -v timeout >/dev/null 2>&1; then timeout "$@"; else shift; "$@"; fi
}

# Whether pip can reach a package index, asked once: pip downloads one tiny wheel (iniconfig, ~7 kB,
# pytest's own dependency) through the user's configuration, no retries, 5 s per connection, the
# whole probe bounded. $reach: "ok", or why not.
reach=""
reachable() {
  if [ -z "$reach" ]; then
    if ! "$PY" -c 'import pip' 2>/dev/null; then
      reach="pip is not installed"
    elif bounded "$PROBE_TIMEOUT" "$PY" -m pip download -q --no-deps --no-cache-dir --only-binary=:all: \
        --retries 0 --timeout 5 -d "$tmp/probe" iniconfig >"$tmp/probe.log" 2>&1; then
      reach=ok
    else
      reach="no package index reachable"
    fi
  fi
  [ "$reach" = ok ]
}

last_error() {  # pip's last error line in log file $1, shortened
  (grep '^ERROR' "$1" || cat "$1") | tail -n 1 | sed 's/^ERROR: //' | cut -c1-160
}

# pip install, quietly, failing in seconds; on failure $why holds pip's last error line.
why=""
pip_install() {
  if "$PY" -m pip install -q "${PIP_OFFLINE_OPTS[@]}" "$@" >"$tmp/pip.log" 2>&1; then return 0; fi
  why="pip install failed: $(last_error "$tmp/pip.log")"
  return 1
}

# optional WHAT CONSEQUENCE CMD...: CMD installs WHAT; where that cannot be, one "skipped" line.
optional() {
  local what=$1 effect=$2
  shift 2
  if ! reachable; then
    skip "$what" "$reach" "$effect"
  else
    echo "setup: installing $what (optional)" >&2
    "$@" || skip "$what" "$why" "$effect"
  fi
}

install_torchrec() {
  # shellcheck disable=SC2086
  pip_install --no-deps $TORCHREC_NODEPS && pip_install $TORCHREC_DEPS
}

# graphshard, editable: pip with the environment's setuptools (no build isolation, no index: works
# offline), else pip with build isolation (fetches setuptools>=64: needs the index).
install_graphshard() {
  echo "setup: installing graphshard (editable)" >&2
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$tmp/graphshard.log" 2>&1 && return 0
  reachable && "$PY" -m pip install -q --no-deps "${PIP_OFFLINE_OPTS[@]}" -e . >>"$tmp/graphshard.log" 2>&1
}

# torch is required: installed when missing and a package index is reachable, else a clear failure.
if [ -n "$need_torch" ]; then
  reachable || die "setup: torch >= 2.11 is required ($PY has: $torch_have) and cannot be installed ($reach):" \
    "install torch >= 2.11 into that environment, or point pip at a package index or a folder of wheels" \
    "(PIP_INDEX_URL, PIP_FIND_LINKS)"
  echo "setup: installing torch==$TORCH_PIN" >&2
  "$PY" -m pip install -q "torch==$TORCH_PIN" \
    || die "setup: could not install torch==$TORCH_PIN (see pip's error above); torch >= 2.11 is required"
  missing=$(check all)
  parse "$missing"
fi

if [ -n "$need_test" ]; then
  optional "${test_missing// /, }" "the test suite cannot run: scripts/test.sh needs pytest and expecttest" \
    pip_install "expecttest>=0.2" "pytest>=8"
fi

# pinned PACKAGE PIN HAVE KEPT_EFFECT MISSING_EFFECT: an optional pinned package; one of another version
# ($HAVE, "-" for none) is kept where the pin cannot be installed.
pinned() {
  local effect=$5
  [ "$3" = "-" ] || effect="keeping $1 $3; $4"
  optional "$1==$2" "$effect" pip_install "$1==$2"
}

[ -z "$need_transformers" ] || pinned transformers "$TRANSFORMERS_PIN" "$transformers_have" \
  "the model-coverage suite runs against it" "the model-coverage suite (tests/test_model_coverage.py) is skipped"

if [ -n "$need_torchrec" ]; then
  optional "the TorchRec stack: ${TORCHREC_NODEPS// /, }, tensordict, torchmetrics, pyre-extensions" \
    "graphshard.model_parallel's TorchRec frontend is unavailable and its tests are skipped" install_torchrec
fi

# Triton, optional (graphshard's own TBE kernels, kernels/triton_tbe.py; on CPU they run under
# TRITON_INTERPRET=1).
[ -z "$need_triton" ] || pinned triton "$triton_want" "$triton_have" "the Triton TBE kernels run on it" \
  "graphshard's Triton TBE kernels (kernels/triton_tbe.py) are unavailable and their tests are skipped"

if [ -n "$need_graphshard" ]; then
  install_graphshard || true
  case $'\n'"$(check graphshard)"$'\n' in
    *$'\n'graphshard$'\n'*)
      cat "$tmp/graphshard.log" >&2
      die "setup: could not install graphshard (editable) into $PY's environment (pip's output above): offline," \
        "pip builds it with that environment's setuptools, which must be >= 64 (with the wheel package below 70.1;" \
        "torch's own requirement brings a recent one)" ;;
  esac
fi
