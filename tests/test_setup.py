"""scripts/setup.sh on a machine that has torch and no package index (issue 27), as on the GPU machine.

Each case builds a throwaway virtual environment under tmp_path (no system site packages, no pip
install): torch, what torch requires and pip are made importable by a ``.pth`` file that points at a
folder of symlinks into this interpreter's site-packages. pip gets no configuration file and an
index on a closed local port, so nothing can be installed; ``scripts/setup.sh`` then runs with
``PYTHON`` set to the venv's python. It must exit 0, install graphshard editable from THIS checkout
into the venv (with its ``torch_dynamo_backends`` entry point) and print one ``setup: skipped``
line for each optional piece it could not get.

The venv has torch with everything torch requires (setuptools included: pip builds the editable
install offline with it). Marked ``offline_setup``: about 10-20 s on 2 cores (``-m "not
offline_setup"`` leaves it out). Nothing outside tmp_path is written.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import time

import pytest

REPO = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
SKIP_LINE = re.compile(r"^setup: skipped (?P<piece>.+) \((?P<why>[^()]+)\); (?P<effect>.+)$")

pytestmark = [pytest.mark.offline_setup,
              pytest.mark.skipif(sys.platform != "linux", reason="a POSIX venv with symlinks and bash")]


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(roots, exclude) -> dict:
    """Installed distributions: roots and what they require (markers evaluated, no extras)."""
    from pip._vendor.packaging.requirements import Requirement  # pip's own, present wherever pip is

    found, todo = {}, list(roots)
    while todo:
        name = todo.pop()
        if _key(name) in found or _key(name) in exclude:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        found[_key(name)] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def _link_tree(dists, folder) -> None:
    """Symlinks to each distribution's top-level files (packages, modules, dist-info) in folder."""
    os.makedirs(folder)
    for dist in dists.values():
        tops = {str(f).replace("\\", "/").split("/")[0] for f in dist.files or []}
        for top in tops - {"..", "__pycache__"}:
            src, dst = str(dist.locate_file(top)), os.path.join(folder, top)
            if os.path.exists(src) and not os.path.lexists(dst):
                os.symlink(src, dst)


@pytest.fixture
def closed_port():
    """A local TCP port bound but not listening: a connection to it is refused at once."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()


def _offline_venv(root, exclude) -> str:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", os.path.join(root, "venv")], check=True)
    py = os.path.join(root, "venv", "bin", "python")
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    _link_tree(_closure(["torch", "numpy", "pip"], exclude), os.path.join(root, "torch-only"))
    with open(os.path.join(purelib, "torch-only.pth"), "w") as f:
        f.write(os.path.join(root, "torch-only") + "\n")
    return py


def _setup(py, port):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHON=py, PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=f"http://127.0.0.1:{port}/simple",
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PIP_NO_CACHE_DIR="1")
    start = time.monotonic()
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "setup.sh")], env=env, capture_output=True,
                       text=True, timeout=300)
    return r, time.monotonic() - start


def test_setup_offline_with_torch_only(tmp_path, closed_port):
    try:
        torch = md.version("torch")
    except md.PackageNotFoundError:
        pytest.skip("torch has no package metadata here")
    system = sorted(os.listdir(sysconfig.get_paths()["purelib"]))
    root = str(tmp_path / "offline")
    try:
        py = _offline_venv(root, {"triton"})
        r, seconds = _setup(py, closed_port)
        print(f"scripts/setup.sh, offline venv: {seconds:.1f} s, exit {r.returncode}\n{r.stderr}")
        assert r.returncode == 0, r.stderr + r.stdout
        assert seconds < 60, f"setup.sh took {seconds:.0f} s offline"

        skipped = [line for line in r.stderr.splitlines() if line.startswith("setup: skipped")]
        assert all(SKIP_LINE.match(line) for line in skipped), skipped
        # Triton: the newest on CPU builds; a CUDA build's own (torch's requirement)
        expected = ["pytest, expecttest", "transformers==5.24.0", "triton==3.9.0" if "+cpu" in torch else "triton=="]
        if torch.startswith("2.13.") and "+cpu" in torch:  # setup.sh's TorchRec condition
            expected.append("the TorchRec stack")
        assert len(skipped) == len(expected), skipped
        for piece in expected:
            assert sum(SKIP_LINE.match(line)["piece"].startswith(piece) for line in skipped) == 1, (piece, skipped)
        assert "the test suite cannot run" in skipped[0]

        # graphshard from THIS checkout, with the entry point that registers backend="graphshard", run
        # from tmp_path (the current directory must not be what makes graphshard importable). Located,
        # not imported: importing graphshard imports torch (8-16 s here).
        probe = ("import importlib.util, json, importlib.metadata as m\n"
                 "files = [importlib.util.find_spec(n).origin for n in "
                 "('graphshard', 'graphshard.passes', 'graphshard.kernels')]\n"
                 "print(json.dumps({'files': files, 'backends': [(e.name, e.value) for e in "
                 "m.entry_points(group='torch_dynamo_backends')]}))")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        out = subprocess.run([py, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        seen = json.loads(out.stdout.splitlines()[-1])
        assert [os.path.realpath(f) for f in seen["files"]] == [os.path.join(REPO, d, "__init__.py")
                                                                for d in ("graphshard", "passes", "kernels")]
        assert ["graphshard", "graphshard.compiler.backend:graphshard_backend"] in seen["backends"], seen

        again, seconds = _setup(py, closed_port)  # idempotent: graphshard is not installed again
        print(f"again: {seconds:.1f} s\n{again.stderr}")
        assert again.returncode == 0, again.stderr
        assert "installing graphshard" not in again.stderr, again.stderr
        assert again.stderr.count("setup: skipped") == len(expected), again.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert sorted(os.listdir(sysconfig.get_paths()["purelib"])) == system  # the system's site-packages untouched
