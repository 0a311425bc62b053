"""Starting and stopping `python -m jaxdp.serve` processes for the end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from jaxdp.net import free_port


class Server:
    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "jaxdp.serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env)

    def wait(self, timeout: float = 240) -> Server:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not come up in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 20 s; then nothing of the server's process group is left (its engine process
        included, even if the server was still starting or died first): what remains after 10 s is killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        t0 = time.time()
        while group_alive(self.proc.pid) and time.time() - t0 < 10:
            time.sleep(0.1)
        if group_alive(self.proc.pid):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def group_alive(pgid: int) -> bool:
    """Whether a process of the group `pgid` still runs (not counting zombies nobody reaped)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            state, _ppid, group = stat[stat.rindex(")") + 2:].split()[:3]
            if int(group) == pgid and state != "Z":
                return True
    return False


def completion_text(url: str, prompt: str, max_tokens: int, stream: bool, timeout: float = 300) -> str:
    """A greedy `/v1/completions` answer's text, streamed (the chunks joined) or not."""
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text
