"""The flags become one ServeConfig (`jaxdp.serve_config.serve_config`), built once, with every flag checked in one
sentence and no JAX backend started, and handed to each process's role (`jaxdp.serve`); the engine process receives
it whole as a typed message on its stdin (`EngineStart`), never as flags, and refuses anything else in one line."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from jaxdp.api.context import Limits
from jaxdp.engine.ipc.messages import EngineStart, WireError, encode
from jaxdp.engine.ipc.process import read_start
from jaxdp.engine.options import DisaggConfig, SpeculativeConfig
from jaxdp.engine.sched.delayer import DelayerConfig
from jaxdp.layout import LayoutError
from jaxdp.model.loader import default_model_path
from jaxdp.serve import ServeConfig, UserError, build_parser, serve_config, server_limits

NODE_1 = ("--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "127.0.0.1:5000")


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("argv", [
    ("--mesh", "dp=2", "--speculative-algorithm", "EAGLE", "--enable-prefill-delayer", "--cuda-graph-bs", "1", "2",
     "--max-queued-requests", "3", "--request-timeout", "2.5", "--api-key", "k", "--dtype", "bfloat16"),
    ("--model-path", "tiny", "--dp-size", "2", "--tp-size", "2", "--replica-num-pages", "8,16", "--no-engine-process",
     "--disaggregation-mode", "prefill", "--skip-tokenizer-init", "--served-model-name", "m"),
    ("--mesh", "dp=4,tp=2,moe=ep", "--max-total-tokens", "4096", "--page-size", "32", *NODE_1, "--dist-timeout", "9"),
])
def test_the_engine_process_reads_the_servers_config_whole(argv):
    config = serve_config(parse(*argv))
    start = read_start(io.BytesIO(encode(EngineStart("ipc://c", "ipc://e", 4321, config))), ServeConfig)
    assert start == EngineStart("ipc://c", "ipc://e", 4321, config)
    assert type(start.config.limits) is Limits and type(start.config.layout) is type(config.layout)
    for part in ("model", "engine", "pool", "dist", "http"):
        assert type(getattr(start.config, part)) is type(getattr(config, part)), part


def test_each_flag_lands_in_the_config_once_checked():
    args = parse("--mesh", "dp=2", "--speculative-algorithm", "nextn", "--enable-prefill-delayer", "--api-key", "k",
                 "--max-request-bytes", "4096", "--request-timeout", "3")
    config = serve_config(args)
    assert config.limits == server_limits(args) == Limits(4096, None, 3.0, 30.0)
    assert config.engine.speculative == SpeculativeConfig("NEXTN", 3, 1, 4)
    assert config.engine.prefill_delayer == DelayerConfig(30, None)
    assert config.model.path == str(default_model_path()) == config.flags["model_path"] == config.tokenizer_path
    assert config.model.dtype == "auto" and config.model.draft  # auto: decided where JAX knows the devices
    assert config.http.api_key == "k" and "api_key" not in config.flags  # /get_server_info shows the flags, not it
    assert config.http.served_model_name == "default-model" and config.layout.dp == 2
    assert config.engine_process and not config.dist.multi
    assert not serve_config(parse("--no-engine-process")).engine_process
    assert not serve_config(parse("--mesh", "dp=4", *NODE_1)).engine_process  # never across nodes
    config = serve_config(parse("--model-path", "tiny", "--skip-tokenizer-init", "--disaggregation-mode", "decode",
                                "--host", "127.0.0.2"))
    assert config.tokenizer_path is None and config.http.served_model_name == "tiny"
    assert config.engine.disaggregation == DisaggConfig("decode", host="127.0.0.2")


@pytest.mark.parametrize("argv, says", [
    (("--engine-process", "--mesh", "dp=4", *NODE_1), "--engine-process runs one node's engine"),
    (("--dp-size", "2", *NODE_1), "--dp-size replicas do not span nodes"),
    (("--dist-timeout", "0",), "--dist-timeout and --dist-init-timeout must be positive"),
    (("--model-path", "/no/such/checkpoint"), "neither a checkpoint directory nor a preset"),
    (("--tokenizer-path", "/"), "--tokenizer-path / has no tokenizer.json"),
    (("--max-request-bytes", "10"), "--max-request-bytes must be at least 1024"),
    (("--replica-num-pages", "8", "--dp-size", "2"), "must give 2 positive page counts"),
    (("--mesh", "dp=2", "--attn-dp-size", "4"), "--attn-dp-size 4 contradicts"),
])
def test_a_bad_flag_is_one_sentence_before_anything_loads(argv, says):
    with pytest.raises((UserError, LayoutError)) as e:
        serve_config(parse(*argv))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_building_the_config_starts_no_jax_backend():
    """The server with an engine process never starts JAX (on a GPU it would take memory the child needs)."""
    code = ("import os; from jaxdp.serve import build_parser, serve_config; "
            "serve_config(build_parser().parse_args(['--mesh', 'dp=2', '--speculative-algorithm', 'EAGLE'])); "
            "tasks = os.listdir('/proc/self/task'); "
            "print(sum(open(f'/proc/self/task/{t}/comm').read().startswith('tf_') for t in tasks))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-1] == "0", out.stderr  # (XLA:CPU's pool threads: tf_*)


def test_the_engine_process_refuses_a_start_that_is_not_one():
    with pytest.raises(WireError, match="Expected `object`, got `str`"):  # the config is not a ServeConfig
        read_start(io.BytesIO(encode(EngineStart("ipc://c", "ipc://e", 1, "dp=8"))), ServeConfig)
    r = subprocess.run([sys.executable, "-m", "jaxdp.serve", "--engine-child"], input=b"\xc1", capture_output=True,
                       timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.startswith("error: the engine process got no start message") and \
        err.count("\n") == 1 and "Traceback" not in err, err
