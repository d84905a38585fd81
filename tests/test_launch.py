"""The launchers: launch_distributed.sh, python -m pycyxwiz.launch, cx.distributed.spawn, mpirun."""
import contextlib
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import ranks

import pycyxwiz as cx

ROOT = Path(__file__).resolve().parents[1]
SH = ROOT / "launch_distributed.sh"

ALLREDUCE = textwrap.dedent("""
    import numpy as np, pycyxwiz as cx
    cx.distributed.init()
    x = np.full(4, cx.distributed.get_rank() + 1.0, np.float32)
    cx.distributed.all_reduce(x)
    print(f"sum {x[0]} world {cx.distributed.get_world_size()}", flush=True)
    cx.distributed.finalize()
""")

ONE_FAILS = textwrap.dedent("""
    import os, sys, time, pycyxwiz as cx
    cx.distributed.init()
    pid_file = os.path.join(sys.argv[1], f"pid{cx.distributed.get_rank()}")
    with open(pid_file + ".tmp", "w") as f:  # whole or absent: the test reads it as soon as it exists
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    if cx.distributed.get_rank() == 1:
        print("rank one fails now", flush=True)
        sys.exit(7)
    time.sleep(60)  # the launcher must stop us long before this
""")


def script(tmp_path, text, name="job.py"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def env_without_rendezvous(**extra):
    env = dict(os.environ)
    for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"]:
        env.pop(v, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_shell_launcher_runs_four_ranks_and_prefixes_their_output(tmp_path):
    job = script(tmp_path, ALLREDUCE)
    r = subprocess.run([str(SH), "4", sys.executable, job], capture_output=True, text=True, timeout=120,
                       env=env_without_rendezvous(MASTER_PORT=ranks.free_port()))
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert lines == [f"[rank {k}] sum 10.0 world 4" for k in range(4)]


def test_shell_launcher_usage_error():
    r = subprocess.run([str(SH), "four", "python", "x.py"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


def test_python_launcher_show_ranks_keeps_only_the_chosen_output(tmp_path):
    job = script(tmp_path, ALLREDUCE)
    r = subprocess.run([sys.executable, "-m", "pycyxwiz.launch", "--nproc-per-node", "3", "--show-ranks", "0,2",
                        job], capture_output=True, text=True, timeout=120,
                       env=env_without_rendezvous(MASTER_PORT=ranks.free_port()))
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[rank 0] sum 6.0 world 3", "[rank 2] sum 6.0 world 3"]


@pytest.mark.parametrize("launcher", ["sh", "python", "python --one-session"])
def test_a_failing_rank_stops_the_others_and_the_launcher_names_it(tmp_path, launcher):
    job = script(tmp_path, ONE_FAILS)
    if launcher == "sh":
        cmd = [str(SH), "3", sys.executable, job, str(tmp_path)]
    else:
        cmd = [sys.executable, "-m", "pycyxwiz.launch", *launcher.split()[1:], "--nproc-per-node", "3", job,
               str(tmp_path)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                       env=env_without_rendezvous(MASTER_PORT=ranks.free_port()))
    assert time.monotonic() - t0 < 30
    assert r.returncode == 7
    assert "rank 1 failed first: it exited with code 7" in r.stderr, r.stderr
    assert "the other ranks stopped because of it: rank 0 was stopped by the launcher; rank 2 was stopped" in r.stderr
    assert "[rank 1] rank one fails now" in r.stdout
    pids = [int((tmp_path / f"pid{k}").read_text()) for k in (0, 2)]
    assert not any(alive(p) for p in pids)


RAISES_LATE = textwrap.dedent("""
    import os, signal, sys, time, numpy as np, pycyxwiz as cx
    cx.distributed.init()
    rank, how = cx.distributed.get_rank(), sys.argv[1]
    x = np.ones(1000, np.float32)
    cx.distributed.all_reduce(x)
    if rank == 3:
        if how == "raise":
            raise ValueError("bad batch 17 on rank three")
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(1000):  # the others go on until they find rank 3 gone
        cx.distributed.all_reduce(x)
        time.sleep(0.01)
""")


@pytest.mark.slow
@pytest.mark.parametrize("how,runs", [("raise", 20), ("kill", 5)])
def test_the_rank_that_failed_first_is_named_not_a_bystander(tmp_path, how, runs):
    # Rank 3 fails; ranks 0-2 die a few milliseconds later of the lost connection, and one of them
    # is often the first exit the launcher sees. The launcher must name rank 3 every time.
    job = script(tmp_path, RAISES_LATE)
    for _ in range(runs):
        r = subprocess.run([sys.executable, "-m", "pycyxwiz.launch", "--nproc-per-node", "4", job, how],
                           capture_output=True, text=True, timeout=120,
                           env=env_without_rendezvous(MASTER_PORT=ranks.free_port()))
        report = r.stderr[r.stderr.index("[launch] rank 3 failed first"):] if "failed first" in r.stderr else r.stderr
        if how == "raise":
            assert r.returncode == 1, r.stderr
            assert report.startswith("[launch] rank 3 failed first: it exited with code 1: ValueError: bad batch 17 "
                                     "on rank three"), r.stderr
            # Rank 3's traceback was shown as it came: the report names the error once and repeats nothing.
            assert "[rank 3] ValueError: bad batch 17 on rank three" in r.stderr
            assert "last lines of rank 3's stderr" not in report and report.count("bad batch 17") == 1, report
        else:
            assert r.returncode == 128 + signal.SIGKILL, r.stderr
            assert report.startswith("[launch] rank 3 failed first: it was killed by SIGKILL"), r.stderr
        others = report[report.index("the other ranks stopped because of it: "):]
        assert all(f"rank {k} " in others for k in (0, 1, 2)) and "rank 3" not in others, report


STREAMS = textwrap.dedent("""
    import os, sys
    print("to stdout", os.environ["RANK"], "threads", os.environ.get("OMP_NUM_THREADS"), flush=True)
    print("to stderr", os.environ["RANK"], file=sys.stderr, flush=True)
""")


def launch(tmp_path, *args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "pycyxwiz.launch", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=env or env_without_rendezvous(MASTER_PORT=ranks.free_port()),
                          **kw)


def test_stderr_of_the_ranks_goes_to_stderr(tmp_path):
    r = launch(tmp_path, "--nproc-per-node", 2, script(tmp_path, STREAMS))
    assert r.returncode == 0, r.stderr
    assert sorted(ln.split(" threads")[0] for ln in r.stdout.splitlines()) == \
        ["[rank 0] to stdout 0", "[rank 1] to stdout 1"]
    assert "[rank 0] to stderr 0" in r.stderr and "[rank 1] to stderr 1" in r.stderr
    assert "to stderr" not in r.stdout


def test_log_dir_writes_each_ranks_streams_to_files_and_tee_shows_them_too(tmp_path):
    job = script(tmp_path, STREAMS)
    r = launch(tmp_path, "--nproc-per-node", 2, "--log-dir", tmp_path / "logs", job)
    assert r.returncode == 0, r.stderr
    assert "to stdout" not in r.stdout and "to stderr" not in r.stderr
    for k in (0, 1):
        assert (tmp_path / "logs" / f"rank_{k}" / "stdout.log").read_text().startswith(f"to stdout {k} threads")
        assert (tmp_path / "logs" / f"rank_{k}" / "stderr.log").read_text() == f"to stderr {k}\n"
    r = launch(tmp_path, "--nproc-per-node", 2, "--log-dir", tmp_path / "logs2", "--tee", job)
    assert r.returncode == 0, r.stderr
    assert "[rank 1] to stdout 1" in r.stdout and "[rank 1] to stderr 1" in r.stderr
    assert (tmp_path / "logs2" / "rank_1" / "stderr.log").read_text() == "to stderr 1\n"
    r = launch(tmp_path, "--nproc-per-node", 2, "--tee", job)
    assert r.returncode != 0 and "--tee" in r.stderr and "--log-dir" in r.stderr


def test_a_module_runs_with_dash_m(tmp_path):
    (tmp_path / "jobpkg").mkdir()
    (tmp_path / "jobpkg" / "__init__.py").write_text("")
    (tmp_path / "jobpkg" / "train.py").write_text(ALLREDUCE.replace("flush=True)", "sys.argv[1:], flush=True)")
                                                  .replace("import numpy", "import sys, numpy"))
    r = launch(tmp_path, "--nproc-per-node", 2, "-m", "jobpkg.train", "--epochs", 3, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == [f"[rank {k}] sum 3.0 world 2 ['--epochs', '3']" for k in (0, 1)]


def test_nproc_per_node_defaults_to_one_and_auto_counts_cpus(tmp_path, monkeypatch):
    r = launch(tmp_path, script(tmp_path, ALLREDUCE))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["[rank 0] sum 1.0 world 1"]
    from pycyxwiz.launch import nproc_from
    monkeypatch.delenv("DISTRIBUTED_BACKEND", raising=False)
    assert nproc_from("auto") == nproc_from("cpu") == len(os.sched_getaffinity(0))
    assert nproc_from("3") == 3
    with pytest.raises(SystemExit, match="'auto', 'cpu' or 'gpu', got 'many'"):
        nproc_from("many")
    if cx._core.dist._cuda_device_count() == 0:
        with pytest.raises(SystemExit, match="--nproc-per-node gpu counts GPUs, and none is visible here"):
            nproc_from("gpu")


def test_omp_num_threads_is_set_for_the_ranks_unless_the_user_set_it(tmp_path):
    job = script(tmp_path, STREAMS)
    r = launch(tmp_path, "--nproc-per-node", 2, job)
    want = max(1, len(os.sched_getaffinity(0)) // 2)
    assert r.returncode == 0, r.stderr
    assert all(ln.endswith(f"threads {want}") for ln in r.stdout.splitlines()), r.stdout
    assert f"[launch] OMP_NUM_THREADS={want} for each rank" in r.stderr
    r = launch(tmp_path, "--nproc-per-node", 2, job,
               env=env_without_rendezvous(MASTER_PORT=ranks.free_port(), OMP_NUM_THREADS=3))
    assert all(ln.endswith("threads 3") for ln in r.stdout.splitlines()), r.stdout
    assert "[launch] OMP_NUM_THREADS" not in r.stderr


@pytest.mark.parametrize("flags", [[], ["--one-session"]])
def test_ranks_die_with_the_launcher_even_when_it_is_killed(tmp_path, flags):
    with sleeping_job(tmp_path, flags) as p:
        pids = [int((tmp_path / f"pid{k}").read_text()) for k in (0, 1)]
        p.kill()
        p.wait()
    deadline = time.monotonic() + 10
    while any(alive(q) for q in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(q) for q in pids)


def test_the_console_script_names_itself_in_its_help():
    exe = Path(sys.executable).parent / "cyxwiz-launch"
    if not exe.exists():
        pytest.skip("the cyxwiz-launch console script is not installed next to this Python")
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: cyxwiz-launch"), r.stdout
    assert "--log-dir" in r.stdout and "-m, --module" in r.stdout


PLACE = textwrap.dedent("""
    import os
    print(os.getsid(0), os.getpgid(0), os.getpid(), os.path.realpath("/proc/self/fd/0"), flush=True)
""")


def test_each_rank_has_a_session_of_its_own_or_with_one_session_the_launchers(tmp_path):
    # Note [One session or one per rank]: by default, a session each (as torchrun); with --one-session
    # the launcher's session, each rank still the leader of its own process group (the launcher stops a
    # rank with killpg) and reading /dev/null (a background group that read the terminal would stop).
    job = script(tmp_path, PLACE)
    py = [sys.executable, "-m", "pycyxwiz.launch", "--nproc-per-node", "3", "--no-prefix"]
    sh = [str(SH), "3"]
    for cmd, one, env in ((py, False, {}), (py + ["--one-session"], True, {}), (sh, True, {"CX_ONE_SESSION": "1"}),
                          (py + ["--one-session"], True, {"CX_ONE_SESSION": "0"}), (sh, False, {"CX_ONE_SESSION": "0"})):
        r = subprocess.run(cmd + [sys.executable, job], capture_output=True, text=True, timeout=120,
                           env=env_without_rendezvous(MASTER_PORT=ranks.free_port(), **env))
        assert r.returncode == 0, r.stderr
        rows = [ln.split()[-4:] for ln in r.stdout.splitlines()]  # the shell launcher keeps the prefix
        assert len(rows) == 3, r.stdout
        for sid, pgid, pid, stdin in rows:
            assert pgid == pid  # its own process group either way
            if one:
                assert int(sid) == os.getsid(0) and stdin == "/dev/null", (cmd, env, rows)
            else:
                assert sid == pid, (cmd, env, rows)


def test_a_bad_cx_one_session_is_refused_by_name(tmp_path):
    r = subprocess.run([str(SH), "2", sys.executable, script(tmp_path, PLACE)], capture_output=True, text=True,
                       timeout=60, env=env_without_rendezvous(MASTER_PORT=ranks.free_port(), CX_ONE_SESSION="yes"))
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.strip() == "launch: CX_ONE_SESSION='yes' is not valid: expected 1 (the ranks in the launcher's " \
                               "session) or 0 (a session per rank)", r.stderr


def test_a_missing_program_or_script_is_one_clear_line(tmp_path):
    r = launch(tmp_path, "--nproc-per-node", 2, "no-such-program-cx")
    assert r.returncode != 0
    assert r.stderr.strip() == "launch: cannot start 'no-such-program-cx': No such file or directory " \
                               "(not found on PATH)", r.stderr
    r = launch(tmp_path, "--nproc-per-node", 2, tmp_path / "nothere.py")
    assert r.returncode != 0 and r.stderr.strip() == f"launch: {tmp_path / 'nothere.py'}: no such file", r.stderr


@contextlib.contextmanager
def sleeping_job(tmp_path, flags=()):
    """A launcher of 2 ranks that sleep, yielded once both have written their pid. Whatever the test
    does, the launcher is gone and its pipes closed at the end (a failed wait must not leave it running)."""
    job = script(tmp_path, ONE_FAILS.replace("== 1", "== 99"))  # nobody fails: all sleep
    # SIGINT as a terminal leaves it: a shell starts a background job (a CI script's `cmd &`) with SIGINT
    # ignored, and Python then never raises KeyboardInterrupt, as the user who ran it in the background wanted.
    p = subprocess.Popen([sys.executable, "-m", "pycyxwiz.launch", *flags, "--nproc-per-node", "2", job, str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env_without_rendezvous(MASTER_PORT=ranks.free_port()),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 90  # two ranks' imports and init on a loaded 2-core machine
        while not all((tmp_path / f"pid{k}").exists() for k in (0, 1)):
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "the ranks did not start within 90 s"
            time.sleep(0.1)
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        if not p.stdout.closed:  # the test's own communicate() closed them where it got that far
            p.communicate()


@pytest.mark.parametrize("flags", [[], ["--one-session"]])
def test_ctrl_c_stops_every_rank(tmp_path, flags):
    with sleeping_job(tmp_path, flags) as p:
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    assert p.returncode == 130 and "interrupted" in err
    assert not any(alive(int((tmp_path / f"pid{k}").read_text())) for k in (0, 1))


def test_sigterm_stops_every_rank_and_exits_143(tmp_path):
    with sleeping_job(tmp_path) as p:
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    assert p.returncode == 143, (p.returncode, err)
    assert "terminated (SIGTERM)" in err
    assert time.monotonic() - t0 < 10  # the ranks' grace period (5 s) and no more
    assert not any(alive(int((tmp_path / f"pid{k}").read_text())) for k in (0, 1))


def test_busy_default_port_makes_the_launcher_pick_a_free_one(tmp_path):
    job = script(tmp_path, ALLREDUCE)
    blocker = socket.socket()
    try:
        blocker.bind(("127.0.0.1", 29500))
        blocker.listen()
    except OSError:
        pass  # already taken by someone else: just as good for this test
    try:
        r = subprocess.run([sys.executable, "-m", "pycyxwiz.launch", "--nproc-per-node", "2", job],
                           capture_output=True, text=True, timeout=120, env=env_without_rendezvous())
    finally:
        blocker.close()
    assert r.returncode == 0, r.stderr
    assert "port 29500 on 127.0.0.1 is in use; using MASTER_PORT=" in r.stderr


def test_two_nodes_on_one_machine_form_one_world(tmp_path):
    job = script(tmp_path, ALLREDUCE)
    port = ranks.free_port()
    cmd = [sys.executable, "-m", "pycyxwiz.launch", "--nproc-per-node", "2", "--nnodes", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port)]
    nodes = [subprocess.Popen(cmd + ["--node-rank", str(k), job], stdout=subprocess.PIPE, text=True,
                              env=env_without_rendezvous()) for k in (1, 0)]
    outs = [n.communicate(timeout=120)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes)
    lines = sorted("".join(outs).splitlines())
    assert lines == [f"[rank {k}] sum 10.0 world 4" for k in range(4)]


# ---- a progress bar through the launcher ----------------------------------------------------

TRAIN = textwrap.dedent("""
    import numpy as np, pycyxwiz as cx
    cx.distributed.init()
    X = np.random.default_rng(0).standard_normal((384, 8)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    model = cx.SequentialModel()
    model.add(cx.LinearModule(8, 16, seed=1)); model.add(cx.ReLUModule()); model.add(cx.LinearModule(16, 2, seed=2))
    trainer = cx.distributed.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(1e-2))
    config = cx.distributed.DistributedTrainingConfig(); config.epochs = 3; config.batch_size = 16
    config.log_every_n_batches = 2
    trainer.fit(X, y, config)
    print("done", flush=True)
    cx.distributed.finalize()
""")

SAYS_BAR = "import os; print('bar', os.environ.get('CX_PROGRESS_BAR'), flush=True)\n"


def on_a_terminal(argv, env, timeout=120):
    """Runs argv with its stdout on a pseudo-terminal (as a person at a shell would); returns
    (exit code, the bytes the terminal received, stderr)."""
    import pty
    import select
    import tempfile
    master, slave = pty.openpty()
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=err, env=env)
        os.close(slave)
        got, deadline = [], time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if not select.select([master], [], [], 1.0)[0]:
                    if p.poll() is not None:
                        break
                    continue
                try:
                    data = os.read(master, 1 << 16)
                except OSError:  # EIO: every writer of the terminal has closed it
                    break
                if not data:
                    break
                got.append(data)
        finally:
            os.close(master)
            if p.poll() is None:
                p.kill()
            p.wait()
        err.seek(0)
        return p.returncode, b"".join(got).decode(errors="replace"), err.read().decode(errors="replace")


def screen(received):
    """The lines a terminal shows after `received`: a carriage return goes back to the start of the
    line (what follows overwrites it), ESC[K erases from there to the end of the line."""
    lines, cur, col = [], [], 0
    for tok in re.split(r"(\r\n|\n|\r|\x1b\[K)", received):
        if tok in ("\r\n", "\n"):
            lines.append("".join(cur))
            cur, col = [], 0
        elif tok == "\r":
            col = 0
        elif tok == "\x1b[K":
            del cur[col:]
        elif tok:
            for ch in tok:
                if col < len(cur):
                    cur[col] = ch
                else:
                    cur.append(ch)
                col += 1
    return lines + (["".join(cur)] if cur else [])


def test_on_a_terminal_rank_0_draws_its_bar_through_the_launcher(tmp_path):
    job = script(tmp_path, TRAIN)
    code, tty, err = on_a_terminal([sys.executable, "-m", "pycyxwiz.launch", "--nproc-per-node", "2",
                                    "--log-dir", str(tmp_path / "logs"), "--tee", job],
                                   env_without_rendezvous(MASTER_PORT=ranks.free_port()))
    assert code == 0, err
    # Each redraw goes back to the start of the line and draws it again behind the prefix ...
    assert re.search(r"\r\[rank 0\] Epoch 1/3 \[=+>?\.*\] \d+/12 - loss", tty), tty
    assert "\r[rank 0] Epoch 3/3 [" in tty and "\x1b[K" in tty
    # ... so the terminal ends up showing one line per epoch, with no bar left over.
    shown = [ln for ln in screen(tty) if ln.startswith("[rank")]
    epochs = [ln for ln in shown if " - loss " in ln]
    assert [ln[:26] for ln in epochs] == [f"[rank 0] Epoch {e}/3 - loss " for e in (1, 2, 3)], shown
    assert all("samples/s - " in ln and "[=" not in ln for ln in epochs), shown
    assert shown[-1] == "[rank 0] done" or "[rank 1] done" in shown[-2:], shown
    # The log file gets plain lines: each redraw as a line of its own, no carriage return.
    log = (tmp_path / "logs" / "rank_0" / "stdout.log").read_text()
    assert "\r" not in log and "\x1b" not in log
    assert any(ln.startswith("Epoch 2/3 [") for ln in log.splitlines()), log
    assert [ln[:17] for ln in log.splitlines() if " - loss " in ln and "[" not in ln] == \
        [f"Epoch {e}/3 - loss " for e in (1, 2, 3)], log
    assert (tmp_path / "logs" / "rank_1" / "stdout.log").read_text() == "done\n"


def test_the_shell_launcher_passes_the_bar_through_too(tmp_path):
    code, tty, err = on_a_terminal([str(SH), "2", sys.executable, script(tmp_path, TRAIN)],
                                   env_without_rendezvous(MASTER_PORT=ranks.free_port()))
    assert code == 0, err
    assert re.search(r"\r\[rank 0\] Epoch 2/3 \[=+>?\.*\] \d+/12 - loss", tty), tty


def test_without_a_terminal_rank_0_prints_plain_lines_and_no_carriage_return(tmp_path):
    r = launch(tmp_path, "--nproc-per-node", 2, script(tmp_path, TRAIN))
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stdout and "\x1b" not in r.stdout
    lines = r.stdout.splitlines()
    assert any(ln.startswith("[rank 0] Epoch 1/3 batch 2/12 - loss ") for ln in lines), lines
    assert [ln[:26] for ln in lines if " - loss " in ln and " batch " not in ln] == \
        [f"[rank 0] Epoch {e}/3 - loss " for e in (1, 2, 3)]


@pytest.mark.parametrize("show,told", [(None, "0"), ("1", "1")])
def test_only_the_rank_shown_first_is_told_it_may_draw_a_bar(tmp_path, show, told):
    job = script(tmp_path, SAYS_BAR)
    argv = [sys.executable, "-m", "pycyxwiz.launch", "--nproc-per-node", "2",
            *(["--show-ranks", show] if show else []), job]
    env = env_without_rendezvous(MASTER_PORT=ranks.free_port())
    env.pop("CX_PROGRESS_BAR", None)
    code, tty, err = on_a_terminal(argv, env)
    assert code == 0, err
    said = sorted(ln for ln in screen(tty) if ln.startswith("[rank"))
    assert said == sorted(f"[rank {k}] bar {'1' if str(k) == told else None}" for k in (0, 1)
                          if show is None or str(k) == show), said
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)  # not a terminal: nobody
    assert r.returncode == 0 and "bar 1" not in r.stdout, r.stdout


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_line_from_another_rank_keeps_the_bar_below_it():
    from pycyxwiz.launch import _Console
    out, err = Terminal(), Terminal()
    c = _Console(out)
    c.redraw("[rank 0] ", "\rEpoch 1/2 [==>...] 1/4\x1b[K")
    c.line(out, "[rank 1] hello\n")
    c.redraw("[rank 0] ", "\rEpoch 1/2 [====>.] 2/4\x1b[K")
    c.line(err, "[rank 0] a warning\n")
    c.redraw("[rank 0] ", "\r\x1b[KEpoch 1/2 - loss 0.5\n")
    c.end()
    assert out.getvalue() == ("\r[rank 0] Epoch 1/2 [==>...] 1/4\x1b[K"
                              "\r\x1b[K[rank 1] hello\n[rank 0] Epoch 1/2 [==>...] 1/4\x1b[K"
                              "\r[rank 0] Epoch 1/2 [====>.] 2/4\x1b[K"
                              "\r\x1b[K[rank 0] Epoch 1/2 [====>.] 2/4\x1b[K"
                              "\r[rank 0] \x1b[KEpoch 1/2 - loss 0.5\n")
    assert err.getvalue() == "[rank 0] a warning\n"
    assert screen(out.getvalue()) == ["[rank 1] hello", "[rank 0] Epoch 1/2 - loss 0.5"]


# ---- cx.distributed.spawn -------------------------------------------------------------

def spawned(rank, n):
    import numpy as np
    cx.distributed.init()
    x = np.full(n, rank + 1.0, np.float32)
    cx.distributed.all_reduce(x)
    cx.distributed.finalize()
    return float(x.sum())


def spawned_fails(rank):
    if rank == 1:
        raise RuntimeError("boom in rank one")
    time.sleep(30)


def test_spawn_returns_every_ranks_result():
    assert cx.distributed.spawn(spawned, 3, args=(5,)) == [30.0, 30.0, 30.0]


def test_spawn_reports_the_failing_rank_and_stops_the_rest():
    t0 = time.monotonic()
    with pytest.raises(cx.distributed.SpawnError, match="rank 1 failed: RuntimeError: boom in rank one"):
        cx.distributed.spawn(spawned_fails, 3)
    assert time.monotonic() - t0 < 20


def guide_worker(rank, world_size, scale):
    """The training-engine guide's train_fn(rank, world_size, **kwargs): the group is already joined."""
    x = np.full(3, (rank + 1) * scale, np.float32)
    cx.distributed.all_reduce(x)
    return rank, world_size, cx.distributed.get_world_size(), float(x[0])


def test_launch_distributed_training_runs_train_fn_in_a_joined_group():
    out = cx.distributed.launch_distributed_training(guide_worker, 3, scale=2.0)
    assert out == [(r, 3, 3, 12.0) for r in range(3)]


def test_a_group_that_cannot_start_falls_back_to_one_process_only_when_asked(monkeypatch):
    # 192.0.2.1 (TEST-NET-1) is nobody: rank 0 cannot host the store there, the others cannot reach it.
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")
    monkeypatch.setenv("DISTRIBUTED_TIMEOUT_MS", "3000")
    with pytest.raises(cx.distributed.SpawnError) as e:
        cx.distributed.launch_distributed_training(guide_worker, 2, scale=1.0)
    assert "the group of 2 processes could not be set up: rank 0: " in str(e.value)
    assert "(fallback=True trains in this process instead)" in str(e.value)
    with pytest.warns(RuntimeWarning, match="fallback=True: training in this process, in a world of one"):
        out = cx.distributed.launch_distributed_training(guide_worker, 2, fallback=True, scale=1.0)
    assert out == [(0, 1, 1, 1.0)] and not cx.distributed.is_initialized()


def test_launch_distributed_training_refuses_a_bad_world_size_or_backend():
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        cx.distributed.launch_distributed_training(guide_worker, 0)
    with pytest.raises(ValueError, match="backend must be 'cpu' or 'nccl', got 'gloo'"):
        cx.distributed.launch_distributed_training(guide_worker, 2, backend="gloo")


# ---- mpirun (Open MPI) ---------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed "
                    "(apt-get install openmpi-bin)")
def test_mpirun_sets_rank_and_world_size_without_extra_variables(tmp_path):
    job = script(tmp_path, ALLREDUCE)
    port = ranks.free_port()
    r = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "3",
                        "-x", f"MASTER_PORT={port}", "-x", "PATH", "-x", "PYTHONPATH",
                        sys.executable, job], capture_output=True, text=True, timeout=120,
                       env=env_without_rendezvous())
    assert r.returncode == 0, r.stdout + r.stderr
    # Open MPI forwards each rank's output through its own I/O channel and may glue two ranks'
    # lines together ("sum 6.0 world 3sum 6.0 world 3"), so count the reports, not the lines.
    assert re.findall(r"sum \S+ world \S+?(?=sum|\s|$)", r.stdout) == ["sum 6.0 world 3"] * 3, r.stdout


LONG_ERROR = textwrap.dedent("""
    import pycyxwiz as cx
    cx.distributed.init()
    if cx.distributed.get_rank() == 1:
        raise ValueError("bad input: " + "x" * 900)
    import time
    time.sleep(60)
""")


@pytest.mark.parametrize("where", ["console", "log_dir"])
def test_a_failed_ranks_long_error_is_reported_once(tmp_path, where):
    """Shown on the console as it came, the traceback is not repeated and the report's line is cut; written
    to a log file, the report shows its last lines, without repeating the error line it already gave."""
    job = script(tmp_path, LONG_ERROR)
    extra = ["--log-dir", tmp_path / "logs"] if where == "log_dir" else []
    r = launch(tmp_path, "--nproc-per-node", 2, *extra, job)
    assert r.returncode == 1, r.stderr
    report = r.stderr[r.stderr.index("[launch] rank 1 failed first"):]
    assert report.startswith("[launch] rank 1 failed first: it exited with code 1: ValueError: bad input: xxx")
    if where == "console":
        assert r.stderr.count("x" * 900) == 1, r.stderr  # the rank's own traceback, above the report
        assert "more characters in rank 1's traceback above" in report and "last lines" not in report, report
    else:
        assert r.stderr.count("x" * 900) == 1, r.stderr  # the report's line: the log file has the rest
        assert "[launch] the last lines of rank 1's stderr:" in report and "Traceback" in report, report
    assert "the other ranks stopped because of it: rank 0 " in report, report
