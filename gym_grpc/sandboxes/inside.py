"""The program that runs inside a bubblewrap sandbox for its whole life and does what the host asks.

It uses the standard library only: bubblewrap.py passes this file's source to
the sandbox's Python with `-c`. It reads requests from stdin and writes
replies to stdout, one JSON object a line; each request has an `id` and is
served in a thread of its own, so that a long command (an agent program)
does not hold up the file operations or the shorter commands beside it.
Binary data travels as base64.

    {"id": 1, "op": "exec", "argv": [...] | "shell": "...", "stdin": b64, "cwd": "/app",
     "env": {...}, "timeout": 30.0, "max_output": 65536}
        -> {"id": 1, "exit_code": 0, "stdout": b64, "stderr": b64, "stdout_bytes": n,
            "stderr_bytes": n, "timed_out": false, "seconds": 0.01}
    {"id": 2, "op": "read", "path": "/app/x", "max_bytes": n} -> {"id": 2, "data": b64, "size": n}
    {"id": 3, "op": "write", "path": "/app/x", "data": b64, "mode": 420} -> {"id": 3}
    {"id": 4, "op": "list", "path": "/app"} -> {"id": 4, "entries": [{"name", "type", "size"}]}
    {"id": 5, "op": "kill_others"} -> {"id": 5, "killed": n}
    {"id": 6, "op": "forward", "port": 8000, "socket": "/run/gym/forward.sock"} -> {"id": 6}
    {"id": 7, "op": "cancel", "target": 1} -> {"id": 7}   (kills exec 1's process group: its caller gave up;
                                                            read before that command runs, it dies as it starts)
    a failure -> {"id": n, "error": "what went wrong"}

The first line it writes, once ready, is {"ready": true, "pid": its pid}.

A command runs in a process group of its own, which is killed with SIGKILL when
the command exits or at its timeout: what it started in the background ends
with it (a fork bomb's processes too), and its answer is sent once they are
gone, so that they no longer count against the sandbox's process limit. Its
output is read as it comes, until it exits; the first `max_output` bytes of
each stream are returned with the stream's full size. Nothing of it is written
to the sandbox's disk, so a full disk does not hide a command's answer.
`forward` listens on 127.0.0.1:port inside the sandbox (whose network has no
other way out) and joins each connection to the Unix socket the host serves.
"""

import base64
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

_out = sys.stdout.buffer
_lock = threading.Lock()
#: The exec requests read and not yet answered, by id: their command's process group once it runs
#: (None before; _CANCELLED when a cancel came first). An exec is entered here as its line is read,
#: before its thread starts, so that a cancel read after it finds it whichever thread runs first.
_running: dict = {}
_running_lock = threading.Lock()
_CANCELLED = -1


def _reply(message):
    line = json.dumps(message, separators=(",", ":")).encode() + b"\n"
    with _lock:
        _out.write(line)
        _out.flush()


def _b64(data):
    return base64.b64encode(data).decode("ascii")


def _feed(fd, data):
    """Write a command's stdin, then close `fd`: in a thread, since the command may read it slowly or
    never; or, when no thread can start, what a non-blocking `fd` takes at once."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        pass  # it ended without reading it all
    finally:
        os.close(fd)


def _exec(request):
    argv = request.get("argv") or ["/bin/sh", "-c", request["shell"]]
    limit = int(request.get("max_output") or 65536)
    timeout = request.get("timeout")
    started = time.monotonic()
    try:
        child = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=request.get("cwd") or None,
            env={**os.environ, **(request.get("env") or {})},
            start_new_session=True,
        )
    except OSError as e:
        return {
            "exit_code": 127,
            "stdout": "",
            "stderr": _b64(f"{argv[0]}: {e.strerror or e}\n".encode()),
            "stdout_bytes": 0,
            "stderr_bytes": 0,
            "timed_out": False,
            "seconds": 0.0,
        }
    with _running_lock:
        cancelled = _running.get(request["id"]) == _CANCELLED
        _running[request["id"]] = child.pid
    if cancelled:  # its caller gave up before it started: it ends at once, as below
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except OSError:
            pass
    stdin = base64.b64decode(request.get("stdin") or "")
    if stdin:
        fd = os.dup(child.stdin.fileno())
        try:
            threading.Thread(target=_feed, args=(fd, stdin), daemon=True).start()
        except RuntimeError:  # no thread to be had (the command already forked to the process limit)
            os.set_blocking(fd, False)
            _feed(fd, stdin)  # what the pipe takes now; the rest is cut, as for a command that stops reading
    child.stdin.close()
    out, err = child.stdout.fileno(), child.stderr.fileno()
    kept = {out: bytearray(), err: bytearray()}
    sizes = dict.fromkeys(kept, 0)
    exited = os.pidfd_open(child.pid)
    selector = selectors.DefaultSelector()
    for fd in kept:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    selector.register(exited, selectors.EVENT_READ)
    timed_out = False

    def drain(fd):
        """Read what the pipe holds now; False at its end."""
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return True
            if not data:
                selector.unregister(fd)
                return False
            sizes[fd] += len(data)
            room = limit - len(kept[fd])
            if room > 0:
                kept[fd] += data[:room]

    # Its output as it comes, until it exits (what its background processes write after that is not
    # waited for) or its time is up.
    while True:
        left = None if timeout is None else started + timeout - time.monotonic()
        if left is not None and left <= 0:
            timed_out = True
            break
        ready = selector.select(left)
        if any(key.fd == exited for key, _ in ready):
            break
        for key, _ in ready:
            drain(key.fd)
    try:  # what it left running in its group ends with it
        os.killpg(child.pid, signal.SIGKILL)
    except OSError:
        pass
    code = child.wait()
    _until_gone(child.pid)
    with _running_lock:  # its group's id is free for another process now: no cancel may use it
        _running.pop(request["id"], None)
    for fd in list(kept):
        if fd in selector.get_map():
            drain(fd)
    selector.close()
    os.close(exited)
    child.stdout.close()
    child.stderr.close()
    return {
        "exit_code": code,
        "stdout": _b64(bytes(kept[out])),
        "stderr": _b64(bytes(kept[err])),
        "stdout_bytes": sizes[out],
        "stderr_bytes": sizes[err],
        "timed_out": timed_out,
        "seconds": time.monotonic() - started,
    }


def _until_gone(group):
    """Return once no process of the group is left, reaped by the sandbox's init (bwrap, pid 1).

    Killed processes take a while to exit and be reaped, and until then they count against the
    sandbox's process limit: a fork bomb's hundreds would refuse the sandbox's next command (even
    the thread that serves it) a moment after its own was answered. They cannot be waited for (they
    are not this program's children) nor fork any more (the kill reached the whole group at once),
    so the group is asked after until it is empty, killed again each time in case. A group whose
    process the kill cannot end (stuck in the kernel) is given up after 30 s, as ended.
    """
    pause, deadline = 0.001, time.monotonic() + 30.0
    while time.monotonic() < deadline:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:  # ESRCH: the group has no process left
            return
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _read(request):
    with open(request["path"], "rb") as f:
        data = f.read(int(request.get("max_bytes") or 1 << 20))
        size = f.seek(0, os.SEEK_END)
    return {"data": _b64(data), "size": size}


def _write(request):
    path = request["path"]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(base64.b64decode(request.get("data") or ""))
    if request.get("mode") is not None:
        os.chmod(path, int(request["mode"]))
    return {}


def _list(request):
    entries = []
    with os.scandir(request["path"]) as found:
        for entry in found:
            try:
                kind = "dir" if entry.is_dir(follow_symlinks=False) else "link" if entry.is_symlink() else "file"
                size = entry.stat(follow_symlinks=False).st_size
            except OSError:
                kind, size = "file", 0
            entries.append({"name": entry.name, "type": kind, "size": size})
    entries.sort(key=lambda e: e["name"])
    return {"entries": entries}


def _kill_others(request):
    """SIGKILL every process of the sandbox but this one and the sandbox's init (pid 1)."""
    killed = 0
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, os.getpid()):
            try:
                os.kill(int(name), signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return {"killed": killed}


def _cancel(request):
    with _running_lock:
        group = _running.get(request["target"])
        if group is None and request["target"] in _running:  # not started yet: killed as it starts
            _running[request["target"]] = _CANCELLED
    if group is not None and group != _CANCELLED:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass
    return {}


def _pump(source, sink):
    try:
        while True:
            data = source.recv(65536)
            if not data:
                break
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _join(conn, path):
    try:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(path)
    except OSError:
        conn.close()
        return
    threading.Thread(target=_pump, args=(upstream, conn), daemon=True).start()
    _pump(conn, upstream)


def _forward(request):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", int(request["port"])))
    listener.listen(128)

    def accept():
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=_join, args=(conn, request["socket"]), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return {}


_OPS = {
    "exec": _exec,
    "read": _read,
    "write": _write,
    "list": _list,
    "kill_others": _kill_others,
    "forward": _forward,
    "cancel": _cancel,
}


def _serve(request):
    try:
        reply = _OPS[request["op"]](request)
    except Exception as e:  # the host gets every failure as an answer, never silence
        reply = {"error": f"{type(e).__name__}: {e}"}
    finally:
        if request.get("op") == "exec":  # answered (a command that ran left as soon as it was reaped)
            with _running_lock:
                _running.pop(request["id"], None)
    reply["id"] = request["id"]
    _reply(reply)


def main():
    os.umask(0o022)
    threading.stack_size(256 << 10)  # threads count against the address-space limit too
    _reply({"ready": True, "pid": os.getpid()})
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
        except ValueError:
            continue
        if request.get("op") == "exec":
            with _running_lock:
                _running[request["id"]] = None
        try:
            threading.Thread(target=_serve, args=(request,), daemon=True).start()
        except RuntimeError:  # no thread to be had (the sandbox's processes are at their limit): serve it here
            _serve(request)


main()
