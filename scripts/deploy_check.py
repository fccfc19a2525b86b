"""Runs examples/deploy's Compose file and Kubernetes Job as written, without a container
runtime: `bash scripts/docker-check.sh --emulate` calls it (as root, with PyYAML and the
wheel installed in PYTHON's environment).

What is real: each container's `command` from the file, as written, run by the image's
Python and `shmbridge` (the wheel, installed as the Dockerfile installs it) in the
Dockerfile's WORKDIR (holding what it COPYs there), as the file's user (`user:`,
`runAsUser`, else the Dockerfile's USER), in PID, network and mount namespaces of its own
(`unshare --pid --net --mount --mount-proc`), its program not process 1 (`init: true`:
a shell is); every container sees one tmpfs as /dev/shm, of the file's size (`shm_size`,
the emptyDir's `sizeLimit`), as `ipc: service:engine` and a memory-backed emptyDir give.
What is emulated, not run: the image (the Dockerfile's FROM and RUN lines: the host's
Debian Python stands for the base image's), the IPC namespace's System V objects (unused
by shmbridge), the network (none: each container gets an empty network namespace),
restarts, and the scheduler. What is checked in the files: the fields that make sharing
work (Compose: the engine's `ipc: shareable`, the others' `ipc: service:<engine>`, one
user; the Job: `restartPolicy` OnFailure or Never, an emptyDir of medium Memory mounted
at /dev/shm in every container, one uid).

Each file is run twice: in its order (the engine first), and with the learner started
first, which must wait for the engine (train.py's deadline) rather than race it: the
engine starts only once the learner has said it waits. Passes when the learner stepped
1000 times and both exited 0, and nothing is left in /dev/shm.

    python deploy_check.py DEPLOY_DIR APP_DIR BIN_DIR
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

DEADLINE = 180.0  # seconds for one run of a file, both containers


def fail(msg: str) -> None:
    print(f"docker-check: FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


def dockerfile(path: Path) -> dict:
    """WORKDIR, USER and the files COPYed into WORKDIR (source, destination) of the
    Dockerfile; it must COPY the built wheel and pip install it."""
    text = path.read_text()
    workdir = re.search(r"^WORKDIR\s+(\S+)", text, re.M)
    user = re.search(r"^USER\s+(\d+):(\d+)", text, re.M)
    if not (workdir and user):
        fail(f"{path}: no WORKDIR or numeric USER uid:gid")
    copies = re.findall(r"^COPY\s+(\S+)\s+(\S+)", text, re.M)
    if not any(src.startswith("dist/shmbridge-") and src.endswith(".whl") for src, _ in copies):
        fail(f"{path}: does not COPY the wheel of scripts/build-wheel.sh (dist/shmbridge-*.whl)")
    if not re.search(r"pip install .*shmbridge-\*\.whl", text):
        fail(f"{path}: does not pip install the wheel")
    into = [(src, dst) for src, dst in copies if dst.startswith(workdir.group(1))]
    return {"workdir": workdir.group(1), "user": (int(user.group(1)), int(user.group(2))), "copies": into}


def size_bytes(text) -> int:
    """`2gb`, `2Gi`, `512m` ... in bytes."""
    m = re.fullmatch(r"(\d+)\s*([kmgt]?)(i?b?)", str(text).strip().lower())
    if not m:
        fail(f"size {text!r} not understood")
    return int(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " ")


def compose_containers(path: Path, image: dict) -> tuple:
    doc = yaml.safe_load(path.read_text())
    services = doc["services"]
    owners = [n for n, s in services.items() if s.get("ipc") == "shareable"]
    if len(owners) != 1:
        fail(f"{path}: one service must own the IPC namespace (ipc: shareable), found {owners}")
    engine = owners[0]
    users = set()
    containers = []
    for name, s in services.items():
        if name != engine and s.get("ipc") != f"service:{engine}":
            fail(f"{path}: service {name} does not share {engine}'s /dev/shm (ipc: service:{engine})")
        if not s.get("init"):
            fail(f"{path}: service {name} runs without init: true (SIGTERM would not reach it)")
        uid, gid = (int(x) for x in str(s.get("user", "%d:%d" % image["user"])).split(":"))
        users.add((uid, gid))
        containers.append({"name": name, "command": s["command"], "user": (uid, gid)})
    if len(users) != 1:
        fail(f"{path}: the services run as different users {users}: a region is 0600")
    return containers, size_bytes(services[engine].get("shm_size", "64m"))


def job_containers(path: Path, image: dict) -> tuple:
    doc = yaml.safe_load(path.read_text())
    if doc.get("kind") != "Job":
        fail(f"{path}: kind {doc.get('kind')}, not Job")
    pod = doc["spec"]["template"]["spec"]
    if pod.get("restartPolicy") not in ("OnFailure", "Never"):
        fail(f"{path}: restartPolicy {pod.get('restartPolicy')!r}: a learner that ends would be restarted forever")
    shm = [v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    if len(shm) != 1:
        fail(f"{path}: no single memory-backed emptyDir volume")
    size = next(v["emptyDir"].get("sizeLimit", "64m") for v in pod["volumes"] if v["name"] == shm[0])
    ctx = pod.get("securityContext", {})
    user = (ctx.get("runAsUser", image["user"][0]), ctx.get("runAsGroup", image["user"][1]))
    containers = []
    for c in pod["containers"]:
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        if mounts.get("/dev/shm") != shm[0]:
            fail(f"{path}: container {c['name']} does not mount {shm[0]} at /dev/shm")
        if "runAsUser" in c.get("securityContext", {}):
            fail(f"{path}: container {c['name']} sets its own runAsUser")
        containers.append({"name": c["name"], "command": c["command"], "user": user})
    return containers, size_bytes(size)


def start(container: dict, app: Path, bin_dir: Path, log: Path) -> subprocess.Popen:
    """The container's command in namespaces of its own, as its user, in the app folder;
    stdout and stderr into `log`."""
    uid, gid = container["user"]
    env = {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
    argv = ["unshare", "--pid", "--fork", "--net", "--mount", "--mount-proc", "--kill-child", "--",
            "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--",
            "sh", "-c", '"$@"; exit $?', "sh", *container["command"]]
    out = open(log, "wb")
    return subprocess.Popen(argv, cwd=app, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_line(proc: subprocess.Popen, log: Path, needle: str, deadline: float) -> None:
    """A bounded poll of the container's output for `needle`."""
    while needle not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            fail(f"never printed {needle!r}:\n{log.read_text(errors='replace')}")
        time.sleep(0.05)


def run(label: str, containers: list, learner_first: bool, app: Path, bin_dir: Path, logs: Path) -> None:
    order = containers[::-1] if learner_first else containers
    deadline = time.monotonic() + DEADLINE
    procs = {}
    t0 = time.monotonic()
    try:
        for c in order:
            log = logs / f"{label}-{c['name']}.log"
            procs[c["name"]] = (start(c, app, bin_dir, log), log)
            if learner_first and c is order[0]:
                wait_for_line(procs[c["name"]][0], log, "waiting for engine", deadline)
        # A bounded poll of both: the first to fail fails the run at once (a learner that
        # raced the engine and gave up would leave the engine waiting for its idle timeout).
        running = dict(procs)
        while running:
            for name, (proc, log) in list(running.items()):
                status = proc.poll()
                if status is None:
                    continue
                if status != 0:
                    fail(f"{label}: {name} exited {status}:\n{log.read_text(errors='replace')}")
                del running[name]
            if running and time.monotonic() > deadline:
                fail(f"{label}: {', '.join(running)} still running after {DEADLINE:g} s")
            time.sleep(0.05)
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    said = "\n".join(log.read_text(errors="replace") for _, log in procs.values())
    if "train.py: 1000 steps of 256 envs" not in said or "client closed after 1000 steps" not in said:
        fail(f"{label}: the learner did not step 1000 times, or the engine did not see it close:\n{said}")
    left = [n for n in os.listdir("/dev/shm")]
    if left:
        fail(f"{label}: left in /dev/shm: {left}")
    first = "learner first, waited for the engine" if learner_first else "engine first"
    print(f"docker-check: {label} ({first}): 1000 steps, both exited 0, /dev/shm empty "
          f"({time.monotonic() - t0:.1f} s)")


def main() -> None:
    deploy, app_root, bin_dir = (Path(a).resolve() for a in sys.argv[1:4])
    image = dockerfile(deploy / "Dockerfile")
    # The image's WORKDIR and what the Dockerfile COPYs into it (paths from the build
    # context, the repository's root).
    app = app_root / image["workdir"].lstrip("/")
    app.mkdir(parents=True, exist_ok=True)
    repo = deploy.parent.parent
    for src, dst in image["copies"]:
        target = app_root / dst.lstrip("/")
        target.write_bytes((repo / src).read_bytes())
        target.chmod(0o644)
    # Beside the image, in the folder docker-check.sh removes when it exits: a failure
    # prints the log that says why, so nothing needs to outlive the run.
    logs = app_root.parent / "logs"
    logs.mkdir(mode=0o755, exist_ok=True)
    for label, (containers, shm_size) in (
        ("compose.yaml", compose_containers(deploy / "compose.yaml", image)),
        ("k8s-job.yaml", job_containers(deploy / "k8s-job.yaml", image)),
    ):
        names = [c["name"] for c in containers]
        if names != ["engine", "learner"]:
            fail(f"{label}: containers {names}, expected engine and learner")
        # One tmpfs of the file's size as /dev/shm for this file's containers.
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={shm_size},mode=1777", "deploy-shm", "/dev/shm"], check=True)
        try:
            print(f"docker-check: {label}: " + "; ".join(f"{c['name']}: {shlex.join(c['command'])}" for c in containers))
            run(label, containers, False, app, bin_dir, logs)
            run(label, containers, True, app, bin_dir, logs)
        finally:
            subprocess.run(["umount", "/dev/shm"], check=True)
    print("docker-check: --emulate: all passed")


if __name__ == "__main__":
    main()
