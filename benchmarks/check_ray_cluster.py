"""The README's Ray cluster recipe, run for real: a head and a second node started with two
``ray start`` on this machine (loopback only), token authentication as Ray 2.59+ needs it, and a
sweep through ``attnscale sweep --ray auto`` on the head, and one from a driver outside the
cluster (``--ray HEAD:PORT``) whose trials land on both nodes.

    python benchmarks/check_ray_cluster.py            # about 30-60 s on 2 busy cores
    python benchmarks/check_ray_cluster.py --no-old   # skip the old recipe's failing join

Steps, as the README's recipe reads (``RAY_AUTH_MODE=token`` on every machine):

1. ``ray get-auth-token --generate`` on the head: creates ``~/.ray/auth_token``;
2. ``ray start --head`` with that token;
3. the old recipe's second node (no ``RAY_AUTH_MODE``, no token) must fail to join (``--no-old``
   skips this step): since Ray 2.59 a head started where a token file exists (any local
   ``ray.init()`` writes one) requires it;
4. ``ray start --address=HEAD:PORT`` with ``RAY_AUTH_TOKEN`` set to the head's token: the cluster
   then has two alive nodes;
5. ``attnscale sweep ... --ray auto`` on the head (the head's environment; ``RAY_ADDRESS`` names
   the cluster, whose address file lives in this run's private temp folder, not ``/tmp/ray``);
6. a driver with the second node's environment (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``) joins by
   address and runs a script experiment reporting its node id: both nodes ran trials.

Each ``ray start`` runs with ``--block`` as a child of this script in its own process group, and
its Ray processes carry this run's private temp folder and ``HOME``; whatever happens they are
stopped by their process ids (SIGTERM, then SIGKILL), never with ``ray stop``, which would stop
every Ray process on the machine, other users' included.  Exit status 0 when every step holds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import machine

from attnscale import sweep

# Seconds a node gets to start (or, for the old recipe, to fail) on a busy 2-core machine.
START_TIMEOUT = 90.0
TRIAL_SECONDS = 2.0   # each node-check trial holds its CPU this long, so two run at once


def node_check(*, x: int) -> dict:
    """Which Ray node ran this trial (a trial holds its node's only CPU for a while)."""
    import ray
    time.sleep(TRIAL_SECONDS)
    return {"x": x, "node": ray.get_runtime_context().get_node_id()}


# Registered by this file imported as the module ``check_ray_cluster`` (benchmarks/ is on the
# nodes' PYTHONPATH), which Ray's workers can import by name; the script's own __main__ is not.
if __name__ != "__main__":
    sweep.experiment("ray-node-check")(node_check)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("ray")), *args]


class Nodes:
    """The ``ray start --block`` processes of this run, and how to stop every process of theirs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, args: list[str], env: dict) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 -- closed with the process
        proc = subprocess.Popen(_ray("start", "--block", *args), env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def ours(self) -> list[int]:
        """Processes whose environment names this run's private temp folder (every Ray process
        this script started inherits it), this script excepted."""
        mark = str(self.root).encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if mark in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids

    def kill_marked(self, mark: str) -> None:
        """SIGKILL the processes of ours whose command line names ``mark`` (a node's temp
        folder): a node started without ``--block``, as the old recipe's is."""
        for pid in self.ours():
            try:
                if mark.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass

    def stop(self) -> list[int]:
        """SIGTERM the ``ray start`` processes (each stops its node), then SIGKILL whatever of
        ours is left; returns the processes that outlived the SIGTERM."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (self.ours() or any(p.poll() is None
                                                                  for p in self.procs)):
            time.sleep(0.5)
        left = self.ours()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        return left


def _node_args(root: Path, name: str) -> list[str]:
    """Ports of a node's agents chosen free, so two nodes (and other users' Ray) share a host."""
    return ["--num-cpus=1", "--disable-usage-stats",
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--dashboard-agent-grpc-port={_free_port()}",
            f"--metrics-export-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
            f"--temp-dir={root / 'ray' / name}"]


def _alive_nodes(address: str, env: dict) -> int:
    """Alive nodes of the cluster at ``address``, asked by a fresh driver with ``env``."""
    code = (f"import ray, logging; ray.init(address={address!r}, logging_level=logging.ERROR); "
            "print(sum(n['Alive'] for n in ray.nodes()))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=START_TIMEOUT, check=False)
    if out.returncode:
        raise RuntimeError(f"cannot join {address}: {out.stderr.strip().splitlines()[-1:]}")
    return int(out.stdout.strip().splitlines()[-1])


def _wait(what: str, ok, timeout: float = START_TIMEOUT) -> float:
    t0 = time.monotonic()
    while not ok():
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{what}: not within {timeout:g} s")
        time.sleep(0.5)
    return time.monotonic() - t0


def _gcs_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-old", action="store_true",
                    help="skip the old recipe's second node (no token), which must fail to join")
    args = ap.parse_args()
    print(machine.load(), flush=True)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="attnscale-raycheck-") as tmp:
        root = Path(tmp)
        nodes = Nodes(root)
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
        src = Path(__file__).resolve().parents[1] / "src"
        bench = Path(__file__).resolve().parent
        base["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(src), str(bench), os.environ.get("PYTHONPATH", "")) if p)
        base["ATTNSCALE_RAYCHECK"] = tmp     # marks every process of this run (Nodes.ours)
        head_home, node_home = root / "head-home", root / "node-home"
        head_home.mkdir()
        node_home.mkdir()
        head_env = {**base, "HOME": str(head_home), "RAY_AUTH_MODE": "token"}
        port = _free_port()
        address = f"127.0.0.1:{port}"
        ok = True
        try:
            # 1: a token generated where Ray looks for it on the head (~/.ray/auth_token).
            subprocess.run(_ray("get-auth-token", "--generate"), env=head_env, check=True,
                           capture_output=True)
            token = (head_home / ".ray" / "auth_token").read_text().strip()
            node_env = {**base, "HOME": str(node_home), "RAY_AUTH_MODE": "token",
                        "RAY_AUTH_TOKEN": token}
            # This process drives the last sweep: Ray reads the mode when it is imported.
            os.environ.update({k: node_env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN",
                                                        "PYTHONPATH", "ATTNSCALE_RAYCHECK")})
            import ray
            print(f"ray {ray.__version__}", flush=True)
            # 2: the head.
            nodes.start("head", ["--head", f"--port={port}", "--include-dashboard=false",
                                 f"--ray-client-server-port={_free_port()}",
                                 *_node_args(root, "head")], head_env)
            t = _wait("the head's GCS answering", lambda: _gcs_answers(port))
            print(f"head up at {address} in {t:.1f} s (token auth)", flush=True)
            # 3: the old recipe's second node: no RAY_AUTH_MODE, no token.
            if not args.no_old:
                old_env = {**base, "HOME": str(node_home)}
                t0 = time.monotonic()
                old = subprocess.run(_ray("start", f"--address={address}",
                                          *_node_args(root, "old")),
                                     env=old_env, capture_output=True, text=True,
                                     timeout=START_TIMEOUT, check=False)
                joined = _alive_nodes(address, {**head_env, "RAY_AUTH_TOKEN": token})
                refused = old.returncode != 0 and joined == 1
                ok &= refused
                print(f"old recipe (no token): exit {old.returncode} after "
                      f"{time.monotonic() - t0:.1f} s, alive nodes {joined} -> "
                      f"{'refused, as expected' if refused else 'NOT refused'}", flush=True)
                nodes.kill_marked(str(root / "ray" / "old"))  # what that node left running
            # 4: the fixed recipe's second node: RAY_AUTH_MODE=token and the head's token.
            nodes.start("node", [f"--address={address}", *_node_args(root, "node")], node_env)
            t = _wait("two alive nodes", lambda: _alive_nodes(address, node_env) == 2)
            print(f"second node joined in {t:.1f} s: 2 alive nodes", flush=True)
            # 5: a sweep from the command line on the head, as the README's recipe runs it.
            out = root / "sweep"
            t0 = time.monotonic()
            cli = subprocess.run([sys.executable, "-m", "attnscale", "sweep", "saturation",
                                  "--grid", "mechanism=scaled,unscaled", "--grid", "d_k=4,16",
                                  "--set", "n=32", "--set", "trials=100", "--out", str(out),
                                  "--ray", "auto"],
                                 env={**head_env, "RAY_ADDRESS": address}, capture_output=True,
                                 text=True, timeout=START_TIMEOUT, check=False)
            done = cli.returncode == 0 and sweep.load(out).complete
            ok &= done
            print(f"attnscale sweep --ray auto (on the head): exit {cli.returncode}, "
                  f"{'complete' if done else 'NOT complete: ' + cli.stderr[-400:]} "
                  f"({time.monotonic() - t0:.1f} s)", flush=True)
            # 6: a driver outside the cluster, with the second node's token, by address.
            import check_ray_cluster  # noqa: F401  (registers ray-node-check, see node_check)
            res = sweep.run("ray-node-check", {"x": [0, 1, 2, 3]}, root / "nodes",
                            ray_address=address)
            if res.failed:
                raise RuntimeError(f"node-check trial failed: {res.failed[0]['error'][-600:]}")
            used = {r["result"]["node"] for r in res}
            ok &= res.complete and len(used) == 2
            print(f"node-check sweep: {len(res)} trials on {len(used)} nodes "
                  f"({json.dumps(sorted(u[:8] for u in used))})", flush=True)
        except Exception as err:  # noqa: BLE001 -- reported, then the nodes are stopped
            ok = False
            print(f"FAILED: {type(err).__name__}: {err}", flush=True)
            for log in sorted(root.glob("*.log")):
                print(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-1500:]}")
        finally:
            left = nodes.stop()
            print(f"stopped; {len(left)} processes needed SIGKILL, {len(nodes.ours())} left",
                  flush=True)
    print(f"{'OK' if ok else 'FAILED'} in {time.monotonic() - t_start:.1f} s; {machine.load()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
