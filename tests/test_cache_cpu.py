"""The kernel cache holds up (CPU only: compiling and loading an object need no GPU).

Concurrent requests for one key from threads and from processes compile it once; a truncated, garbage
or unsealed object is discarded, rebuilt and warned about; a cache of another version is ignored and
left untouched; a warm cache serves a new process without a compile. One small variant keeps each
compile around a quarter of a second.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from cake_cute.kernels.config import overridden
from cake_cute.kernels.tiling import forward_tiling
from cake_cute.runtime import build
from cake_cute.runtime import cache as cc
from cake_cute.runtime.specs import KernelSpec

SPEC = KernelSpec("fwd", "sm_90a", "bf16", "bf16", 512)
OTHER = KernelSpec("fwd", "sm_90a", "fp16", "fp16", 512)

# A child process: imports everything, signals "ready", waits for "go", then asks for SPEC and prints
# "<source> <compiles> <seconds> <callable>". The start line lets several children race on one cold key.
CHILD = """
import sys, time
from pathlib import Path
import cutlass.cute
from cake_cute.runtime import cache as cc
spec = cc.KernelSpec("fwd", "sm_90a", "bf16", "bf16", 512)
cc.fingerprint()
go, ready = Path(sys.argv[1]), Path(sys.argv[2])
ready.touch()
while not go.exists():
    time.sleep(0.002)
start = time.perf_counter()
fn, source = cc.get_kernel_and_source(spec)
print(source.replace(" ", "_"), cc.compile_count, time.perf_counter() - start, callable(fn))
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory and an empty in-memory cache for this test."""
    root = tmp_path / "cache"
    monkeypatch.setenv("CAKE_CUTE_CACHE_DIR", str(root))
    monkeypatch.setattr(cc, "_memory", {})
    monkeypatch.setattr(cc, "_key_locks", {})
    return root


def _children(
    cache_root: Path, tmp_path: Path, n: int, timeout: float = 120
) -> list[tuple[str, int, float, bool]]:
    """Run ``n`` CHILD processes against ``cache_root``, released together; their (source, compiles,
    seconds, ok)."""
    env = dict(os.environ, CAKE_CUTE_CACHE_DIR=str(cache_root))
    go = tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(n)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(go), str(r)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in ready
    ]
    try:
        deadline = time.monotonic() + timeout
        while not all(r.exists() for r in ready):
            assert all(p.poll() is None for p in procs), "a child died before the start line"
            assert time.monotonic() < deadline, "children did not get ready"
            time.sleep(0.01)
        go.touch()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err
            source, compiles, seconds, ok = out.split()[-4:]
            results.append((source.replace("_", " "), int(compiles), float(seconds), ok == "True"))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _sound(spec: KernelSpec) -> bool:
    """The object on disk matches its checksum and loads."""
    fn, problem = cc._load(cc.object_path(spec), spec)
    return fn is not None and problem is None


def _snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def test_threads_asking_for_one_key_compile_it_once(cache):
    n = 8
    barrier = threading.Barrier(n)
    results = [None] * n
    errors = []

    def ask(i):
        try:
            barrier.wait()
            results[i] = cc.get_kernel(SPEC)
        except Exception as exc:  # surfaced below; a thread's exception would be lost
            errors.append(exc)

    before = cc.compile_count
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert cc.compile_count - before == 1
    assert all(fn is results[0] for fn in results) and callable(results[0])
    assert _sound(SPEC)


def test_a_cache_hit_does_not_wait_for_another_keys_compile(cache, monkeypatch):
    """Key A is on disk; while key B is (slowly) compiling in another thread, A loads at once."""
    cc.get_kernel(SPEC)
    cc.clear_memory()
    real_compile = build.compile_kernel
    compiling, release = threading.Event(), threading.Event()

    def slow_compile(spec):
        if spec == OTHER:
            compiling.set()
            release.wait(60)
        return real_compile(spec)

    monkeypatch.setattr(build, "compile_kernel", slow_compile)
    other = threading.Thread(target=cc.get_kernel, args=(OTHER,))
    other.start()
    try:
        assert compiling.wait(60)
        hit = threading.Thread(target=cc.get_kernel, args=(SPEC,))
        hit.start()
        hit.join(30)
        assert not hit.is_alive(), "a cache hit waited for another key's compile"
        assert SPEC in cc._memory and OTHER not in cc._memory
    finally:
        release.set()
        other.join(120)
    assert OTHER in cc._memory


def test_processes_racing_on_one_key_compile_it_once(cache, tmp_path):
    results = _children(cache, tmp_path, 2)
    assert sum(compiles for _, compiles, _, _ in results) == 1, results
    assert all(ok for _, _, _, ok in results)
    # The one that did not compile says where it found the kernel (usually after waiting for the lock).
    assert sorted(source for source, _, _, _ in results)[0] == "compiled", results
    assert sorted(source for source, _, _, _ in results)[1] in ("disk", "disk after waiting"), results
    assert _sound(SPEC)


def test_a_warm_cache_serves_a_new_process_without_compiling(cache, tmp_path):
    cc.get_kernel(SPEC)
    [(source, compiles, seconds, ok)] = _children(cache, tmp_path, 1)
    print(f"warm load in a new process: {seconds * 1e3:.1f} ms")
    assert compiles == 0 and ok and source == "disk"
    assert seconds < 1.0  # a compile of even this small kernel takes longer; a load is milliseconds


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path):
    path.write_bytes(os.urandom(path.stat().st_size))


def _unsealed(path):  # the writer died between the object and its checksum
    cc._checksum_path(path).unlink()


def _garbage_with_checksum(path):  # a matching checksum, but not an object file: the load fails
    data = b"\x7fELF" + os.urandom(4096)
    path.write_bytes(data)
    cc._checksum_path(path).write_text(hashlib.sha256(data).hexdigest())


@pytest.mark.parametrize(
    "damage", [_truncate, _garbage, _unsealed, _garbage_with_checksum], ids=lambda f: f.__name__.strip("_")
)
def test_a_damaged_object_is_discarded_and_rebuilt(cache, damage):
    cc.get_kernel(SPEC)
    path = cc.object_path(SPEC)
    damage(path)
    damaged = path.read_bytes()
    assert not cc.is_cached_on_disk(SPEC) or damage is _garbage_with_checksum
    cc.clear_memory()
    before = cc.compile_count
    with pytest.warns(RuntimeWarning, match="discarding cached kernel"):
        fn = cc.get_kernel(SPEC)
    assert cc.compile_count - before == 1
    assert callable(fn)
    assert path.read_bytes() != damaged or damage is _unsealed  # the compile is deterministic
    assert cc.is_cached_on_disk(SPEC) and _sound(SPEC)


def test_a_cache_of_another_version_is_ignored_and_untouched(cache, monkeypatch):
    monkeypatch.setattr(cc, "_fingerprint", "0" * 16)
    cc.get_kernel(SPEC)
    foreign_dir = cc.object_path(SPEC).parent
    monkeypatch.setattr(cc, "_fingerprint", "1" * 16)
    # Plant garbage under the name this version will use, inside the foreign directory.
    (foreign_dir / cc.object_path(SPEC).name).write_bytes(b"not ours")
    before = _snapshot(foreign_dir)
    cc.clear_memory()
    count = cc.compile_count
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cc.get_kernel(SPEC)
    # Nothing is "discarded": the foreign files are not ours to judge.
    assert not [w for w in caught if "cake_cute" in str(w.message)]
    assert cc.compile_count - count == 1
    assert cc.object_path(SPEC).parent == cache / ("1" * 16) != foreign_dir
    assert _snapshot(foreign_dir) == before
    assert _sound(SPEC)


def test_the_key_covers_the_modules_the_kernels_are_built_from():
    """The kernels, the build path and what they import are hashed, by module name; the host path, the
    tools and the cache are not. A code edit to any hashed module, or a renamed module, changes the
    digest the fingerprint is made of."""
    sources = cc.build_sources()
    import cake_cute.kernels

    kernel_files = Path(cake_cute.kernels.__file__).parent.glob("*.py")
    kernels = {f"cake_cute.kernels.{p.stem}".removesuffix(".__init__") for p in kernel_files}
    assert kernels | {"cake_cute.runtime.build", "cake_cute.runtime.specs", "cake_cute.vocab"} <= set(sources)
    assert not {"cake_cute.launch", "cake_cute.autograd", "cake_cute.runtime.cache"} & set(sources)
    assert not any(".tools" in name for name in sources)
    base = cc.source_digest(sources)
    for name, text in sources.items():
        assert cc.source_digest({**sources, name: text + "\n_edited = 1\n"}) != base, name
    renamed = dict(sources)
    first = sorted(renamed)[0]
    renamed[first + "_moved"] = renamed.pop(first)
    assert cc.source_digest(renamed) != base


def test_a_docstring_or_comment_edit_keeps_the_key_and_a_code_edit_changes_it():
    sources = cc.build_sources()
    base = cc.source_digest(sources)
    name = "cake_cute.kernels.rmsnorm_bwd"
    text = sources[name]
    assert '"""RMSNorm backward:' in text and "    def gradient(self, tXrGs)" in text
    reworded = text.replace('"""RMSNorm backward:', '"""# The RMSNorm backward,\n\nreworded:')
    commented = reworded.replace(
        "    def gradient(self, tXrGs)", "    # A comment.\n\n    def gradient(self, tXrGs)"
    )
    assert cc.source_digest({**sources, name: commented}) == base
    edited = text.replace("    def gradient(self, tXrGs)", "    def gradient(self, tXrG_parts)")
    assert cc.source_digest({**sources, name: edited}) != base
    config = sources["cake_cute.kernels.config"]
    assert "MAX_G_PARTS = 3\n" in config
    four_parts = config.replace("MAX_G_PARTS = 3", "MAX_G_PARTS = 4")
    assert cc.source_digest({**sources, "cake_cute.kernels.config": four_parts}) != base


KEY = "from cake_cute.runtime import cache as cc; print(cc.fingerprint(), cc.__file__)"


def _key_and_file(env: dict, cwd: Path) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", KEY], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_an_editable_install_and_a_wheel_of_one_commit_share_the_key(tmp_path):
    """A wheel built from this checkout and installed into its own directory gives the fingerprint of
    the checkout this test imports (an editable install or a source tree): the kernels, which the
    wheel holds inside the package, hash under the same names."""
    repo = Path(cc.__file__).resolve().parents[1]
    if not (repo / "pyproject.toml").is_file():
        pytest.skip("needs the source checkout cake_cute is imported from")
    source = tmp_path / "source"  # a copy, so that the build leaves nothing in the checkout
    shutil.copytree(repo / "cake_cute", source / "cake_cute", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(repo / name, source / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    # Without PYTHONPATH: a checkout on it would offer its own cake_cute to the wheel's run.
    clean = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    wheels, target = tmp_path / "wheels", tmp_path / "target"
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, source]
    subprocess.run(build, env=clean, cwd=tmp_path, check=True)
    (wheel,) = wheels.glob("*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", target, wheel], env=clean, cwd=tmp_path, check=True
    )

    checkout_key, checkout_file = _key_and_file(dict(os.environ), tmp_path)
    wheel_key, wheel_file = _key_and_file({**clean, "PYTHONPATH": str(target)}, tmp_path)
    assert Path(wheel_file).is_relative_to(target) and not Path(checkout_file).is_relative_to(target)
    assert wheel_key == checkout_key


def test_a_config_override_compiles_into_its_own_object(cache):
    """The config is part of the key: an overridden tiling for one H never loads the default's object,
    and leaving the override brings the default's back without a compile."""
    cc.get_kernel(SPEC)
    default_path = cc.object_path(SPEC)
    default = forward_tiling(512, "bf16")
    narrower = replace(default, threads_per_row=default.threads_per_row // 2, vecs_per_thread=2)
    before = cc.compile_count
    with overridden("fwd", "sm_90a", "bf16", 512, tiling=narrower):
        assert build.config_for(SPEC).tiling == narrower
        assert cc.object_path(SPEC) != default_path
        assert callable(cc.get_kernel(SPEC))
    assert cc.compile_count - before == 1
    assert cc.object_path(SPEC) == default_path
    cc.get_kernel(SPEC)
    assert cc.compile_count - before == 1


def test_a_held_lock_times_out_with_the_lock_file_named(cache, monkeypatch):
    path = cc.object_path(SPEC)
    path.parent.mkdir(parents=True)
    monkeypatch.setattr(cc, "LOCK_TIMEOUT_S", 0.2)
    with cc._file_lock(path):  # as another process would hold it
        errors = []

        def ask():
            try:
                cc.get_kernel(SPEC)
            except RuntimeError as exc:
                errors.append(exc)

        waiter = threading.Thread(target=ask)  # a lock is reentrant in the thread that holds it
        waiter.start()
        waiter.join(30)
    assert len(errors) == 1 and f"{path}.lock" in str(errors[0]) and "waited 0.2 s" in str(errors[0])


def test_each_call_says_where_its_kernel_came_from(cache):
    assert cc.get_kernel_and_source(SPEC)[1] == "compiled"
    assert cc.get_kernel_and_source(SPEC)[1] == "memory"
    cc.clear_memory()
    assert cc.get_kernel_and_source(SPEC)[1] == "disk"
