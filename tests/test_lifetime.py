"""Every child owned: an embedded serve's Redis and worker die with it, one server per data
folder, workers given no keys, and ``Settings`` the only reader of the environment.

The process tests read ``/proc`` (Linux, where the parent-death signal is used).
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from embgeom.lifetime import spawn
from embgeom.settings import NOT_FOR_WORKERS, Settings
from embgeom.store.server import DataDirBusy, RedisServer
from embgeom.testing.serve import REPO, ServiceProcess, wait_ready

SECRET = "s3cret-key-of-the-test"


# ------------------------------------------------------------------ /proc helpers
def state(pid: int):
    """The process state letter of ``pid`` (``Z`` zombie), None when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    return state(pid) not in (None, "Z")


def children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid and alive(int(entry.name)):
                found.append(int(entry.name))
    return sorted(found)


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def redis_servers_in(folder: Path) -> list[int]:
    """Live redis-server processes working in ``folder`` (redis chdirs into its --dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cwd = os.readlink(entry / "cwd")
            except OSError:
                continue
            if cwd == str(folder.resolve()) and "redis-server" in command(int(entry.name)) \
                    and alive(int(entry.name)):
                found.append(int(entry.name))
    return sorted(found)


def environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def wait_gone(pids, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def serve(tmp_path: Path, data: Path, name: str, env=None) -> tuple[ServiceProcess, str]:
    proc = ServiceProcess.serve(data_dir=data, env=env, log_path=tmp_path / f"{name}.log").start()
    return proc, proc.url


def embedded_children(proc: ServiceProcess, data: Path, timeout: float = 60) -> tuple[int, int]:
    """(redis-server pid, worker pid) of a ready embedded serve."""
    deadline = time.monotonic() + timeout
    while True:
        kids = children(proc.process.pid)
        redis_pids = [p for p in kids if "redis-server" in command(p)]
        workers = [p for p in kids if "embgeom.cli worker" in command(p)]
        if redis_pids and workers:
            return redis_pids[0], workers[0]
        assert time.monotonic() < deadline, [command(p) for p in kids]
        time.sleep(0.2)


# ------------------------------------------------------------------ a serve and its children
def test_serve_sigkill_takes_its_redis_and_worker_with_it(tmp_path):
    data = tmp_path / "data"
    proc, url = serve(tmp_path, data, "serve")
    redis_pid = worker_pid = None
    try:
        wait_ready(url, process=proc)
        redis_pid, worker_pid = embedded_children(proc, data)
        os.kill(proc.process.pid, signal.SIGKILL)  # the serve alone, as the OOM killer does
        proc.process.wait(timeout=10)
        left = wait_gone([redis_pid, worker_pid], timeout=10)
        assert not left, f"outlived their serve: {[(p, command(p)) for p in left]}"
        assert not redis_servers_in(data / "redis")
    finally:
        proc.kill()
        for pid in (redis_pid, worker_pid):  # the old behaviour: orphans this test made
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def live_serve(tmp_path_factory):
    """An embedded serve with API keys in its environment: (process, url, data folder)."""
    tmp = tmp_path_factory.mktemp("live")
    data = tmp / "data"
    env = {"EMBGEOM_API_KEY": SECRET, "EMBGEOM_API_KEYS": f'{{"{SECRET}-2": ["read"]}}',
           "EMBGEOM_LEASE_SECONDS": "7.5"}
    proc, url = serve(tmp, data, "live", env=env)
    try:
        wait_ready(url, process=proc)
        yield proc, url, data
    finally:
        proc.terminate()


def test_a_second_serve_on_a_live_data_folder_refuses(live_serve, tmp_path):
    first, url, data = live_serve
    before = redis_servers_in(data / "redis")
    assert len(before) == 1
    second, second_url = serve(tmp_path, data, "second")
    started = set()
    try:
        deadline = time.monotonic() + 120
        while second.process.poll() is None and time.monotonic() < deadline:
            started.update(children(second.process.pid))
            # Every moment it runs, the folder has one Redis: the first serve's.
            assert redis_servers_in(data / "redis") == before
            time.sleep(0.1)
        code = second.process.poll()
        log = (tmp_path / "second.log").read_text()
        assert code is not None and code != 0, log
        assert f"{(data / 'redis').resolve()} is in use by another embgeom server (pid {first.process.pid}" in log
        assert redis_servers_in(data / "redis") == before
        wait_ready(url, timeout=10)  # the first one is untouched
    finally:
        second.kill()
        for pid in started:  # children of a second serve that did start (the old behaviour)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_worker_environment_holds_no_api_keys(live_serve):
    proc, _, data = live_serve
    _, worker_pid = embedded_children(proc, data)
    env = environment(worker_pid)
    assert not any(SECRET in v for v in env.values()), sorted(env)
    assert not {"EMBGEOM_API_KEY", "EMBGEOM_API_KEYS"} & set(env)
    # ...and it has what a worker reads: its settings and Redis, and the ordinary environment.
    assert env["EMBGEOM_LEASE_SECONDS"] == "7.5" and env["EMBGEOM_REDIS_URL"].startswith("redis://")
    assert env["PATH"] == os.environ["PATH"]
    assert "--no-env-file" in command(worker_pid)  # nor does it read the keys from .env


def test_worker_environment_leaves_out_keys_from_every_source(monkeypatch):
    monkeypatch.setenv("EMBGEOM_API_KEY", SECRET)
    monkeypatch.setenv("EMBGEOM_METRICS_REQUIRE_KEY", "true")
    monkeypatch.setenv("EMBGEOM_SOMETHING_ELSE", SECRET)  # not a field: not inherited either
    monkeypatch.setenv("REDIS_SERVER_BIN", "/opt/redis/bin/redis-server")  # older name of a field
    settings = Settings(_env_file=None, api_keys={f"{SECRET}-2": ["admin"]}, lease_seconds=9.0)
    assert settings.api_key == SECRET and settings.redis_server_bin == "/opt/redis/bin/redis-server"
    env = settings.worker_environment()
    assert not any(SECRET in v for v in env.values())
    assert not {f"EMBGEOM_{f.upper()}" for f in NOT_FOR_WORKERS} & set(env)
    assert "REDIS_SERVER_BIN" not in env
    assert env["EMBGEOM_REDIS_SERVER_BIN"] == "/opt/redis/bin/redis-server"
    # A worker built from that environment has the same settings, less what it never reads.
    monkeypatch.setattr(os, "environ", dict(env))
    again = Settings(_env_file=None)
    assert again.model_dump(exclude=set(NOT_FOR_WORKERS)) == settings.model_dump(exclude=set(NOT_FOR_WORKERS))


def _attribute_reads(tree: ast.AST) -> set[str]:
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def test_workers_never_read_the_settings_they_are_not_given():
    """A field of NOT_FOR_WORKERS read by worker code would silently take its default there."""
    # embgeom/testing/ is no worker's: nothing of the product imports it (test_import_graph).
    worker_side = [p for p in (REPO / "embgeom").rglob("*.py")
                   if p.name not in ("settings.py", "client.py", "cli.py")
                   and (REPO / "embgeom" / "testing") not in p.parents]
    for path in worker_side:
        used = _attribute_reads(ast.parse(path.read_text())) & NOT_FOR_WORKERS
        assert not used, f"{path.relative_to(REPO)} reads {used}"


# ------------------------------------------------------------------ Settings reads the environment
# Writes are allowed (they set variables that libraries or child processes read):
# ``os.environ.update(...)``, ``os.environ.setdefault(...)`` as statements, ``os.environ[k] = v``.
_WRITES = {"update", "setdefault"}


def environment_reads(source: str) -> list[int]:
    """Lines of ``source`` that read the process environment."""
    tree = ast.parse(source)
    writes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
                and isinstance(node.value.func, ast.Attribute) and node.value.func.attr in _WRITES:
            writes.add(id(node.value.func.value))
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            writes.add(id(node.value))
    lines = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb", "getenv", "getenvb"):
            name = node.attr
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if {a.name for a in node.names} & {"environ", "environb", "getenv", "getenvb"}:
                lines.append(node.lineno)
        if name and id(node) not in writes:
            lines.append(node.lineno)
    return sorted(lines)


def test_the_environment_reads_check_sees_reads_and_writes():
    reads = textwrap.dedent("""\
        import os
        a = os.environ.get("X")
        b = os.getenv("X")
        c = os.environ["X"]
        d = {**os.environ}
        from os import environ
        os.environ.update({"A": "1"})
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ["B"] = "2"
        """)
    assert environment_reads(reads) == [2, 3, 4, 5, 6]


def test_no_module_outside_settings_reads_the_environment():
    found = {}
    for folder in ("embgeom", "service"):
        for path in sorted((REPO / folder).rglob("*.py")):
            # embgeom/testing/ starts children for tests and benchmarks with this process's
            # environment plus theirs; nothing of the product imports it (test_import_graph).
            if path == REPO / "embgeom" / "settings.py" or REPO / "embgeom" / "testing" in path.parents:
                continue
            lines = environment_reads(path.read_text())
            if lines:
                found[str(path.relative_to(REPO))] = lines
    assert not found, f"read the environment outside Settings: {found}"


# ------------------------------------------------------------------ the mechanisms
PARENT = textwrap.dedent("""\
    import signal, sys, threading, time
    from embgeom.lifetime import spawn
    box = []
    # Forked on behalf of a thread that ends at once: the child must not get its signal then.
    t = threading.Thread(target=lambda: box.append(spawn(["sleep", "300"], watchdog=%s)))
    t.start(); t.join()
    print(box[0].pid, flush=True)
    time.sleep(300)
    """)


@pytest.mark.parametrize("watchdog", [False, True], ids=["prctl", "watchdog"])
def test_a_child_outlives_its_forking_thread_but_not_its_parent(watchdog):
    assert_child_outlives_its_thread_not_its_parent(PARENT % watchdog)


def assert_child_outlives_its_thread_not_its_parent(script: str) -> None:
    """Run ``script`` as a parent process that prints the pid of a child it started from a
    short-lived thread; the child must be alive a second later, and gone within 10 s of
    the parent's SIGKILL."""
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, text=True)
    child = int(parent.stdout.readline())
    try:
        assert child != parent.pid
        time.sleep(1.0)
        assert alive(child), "died with the thread that started it"
        parent.kill()
        parent.wait(timeout=10)
        assert not wait_gone([child], timeout=10)
    finally:
        parent.kill()
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_one_redis_per_data_folder(tmp_path):
    second = RedisServer(tmp_path / "redis")
    with RedisServer(tmp_path / "redis") as first:
        try:
            with pytest.raises(DataDirBusy, match=f"pid {os.getpid()}, redis-server pid {first.process.pid}"):
                second.start()
        finally:
            second.kill()
        assert redis_servers_in(tmp_path / "redis") == [first.process.pid]
    # Released with the server: the folder can be served again (a restart from the AOF).
    with RedisServer(tmp_path / "redis") as again:
        assert redis_servers_in(tmp_path / "redis") == [again.process.pid]


def test_a_killed_redis_restarts_once_its_aof_rewrite_child_ends(tmp_path):
    """Redis SIGKILLed during an AOF rewrite: the rewrite child inherited the folder's lock
    and finishes its file. A restart waits for it (here about 3 s) instead of refusing at
    once as if another server held the folder (the soak's Redis fault hit this), and every
    key is back from the AOF."""
    import redis as redis_py

    first = RedisServer(tmp_path / "redis").start()
    client = redis_py.Redis(port=first.port)
    for i in range(30):
        client.set(f"k{i}", "x" * 100)
    client.config_set("rdb-key-save-delay", 100000)  # 0.1 s a key: a rewrite of about 3 s
    client.bgrewriteaof()
    children = Path(f"/proc/{first.process.pid}/task/{first.process.pid}/children")
    deadline = time.monotonic() + 5
    while not children.read_text().split() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # the child has started writing
    client.close()
    first.kill()
    with pytest.raises(DataDirBusy, match=f"after its redis-server \\(pid {first.process.pid}\\) ended"):
        RedisServer(tmp_path / "redis").start(timeout=0.5)
    again = RedisServer(tmp_path / "redis").start(timeout=30)
    try:
        assert redis_py.Redis(port=again.port).dbsize() == 30
    finally:
        again.stop()


def test_spawn_sets_niceness():
    child = spawn(["sleep", "30"], nice=7)
    try:
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == os.getpriority(os.PRIO_PROCESS, 0) + 7
    finally:
        child.kill()
        child.wait()


def test_a_value_in_dotenv_reaches_every_reader(tmp_path, monkeypatch):
    """``.env`` is read by ``Settings``: the corpora, the model cache, the Redis binary and the
    client commands see what the service sees."""
    from embgeom import cli, corpora, sources
    from embgeom.store.server import redis_server_binary

    for name in ("EMBGEOM_CORPORA_DIR", "EMBGEOM_CACHE_DIR", "EMBGEOM_URL", "EMBGEOM_LOG_LEVEL",
                 "EMBGEOM_REDIS_SERVER_BIN", "REDIS_SERVER_BIN"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / ".env").write_text(
        f"EMBGEOM_CORPORA_DIR={tmp_path / 'corpora'}\nEMBGEOM_CACHE_DIR={tmp_path / 'cache'}\n"
        "REDIS_SERVER_BIN=/opt/redis-7/bin/redis-server\nEMBGEOM_URL=http://10.1.2.3:9000\n"
        "EMBGEOM_LOG_LEVEL=WARNING\n")
    monkeypatch.chdir(tmp_path)
    assert corpora._wiki_dirs()[0] == tmp_path / "corpora"
    assert sources.default_cache_dir() == tmp_path / "cache"
    assert redis_server_binary() == "/opt/redis-7/bin/redis-server"
    seen = {}
    monkeypatch.setattr(cli, "table_command", lambda args: seen.update(vars(args)) or 0)
    assert cli.main(["table"]) == 0
    assert seen["url"] == "http://10.1.2.3:9000" and seen["log_level"] == "warning"
