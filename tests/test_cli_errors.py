"""Every ``fleetllm`` subcommand answers a user's mistake with one line on stderr and exit status 2, no traceback.

Each row runs ``fleetllm.cli.main(argv)`` in this process and names a word the line must hold (what was wrong or
what would be right). ``{tmp}`` in an argument is a directory of this module's bad files (see ``bad_files``);
``{closed}`` an http:// address where nothing listens. Every mistake is found before a model loads or a server
starts, so the table runs in a few seconds.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from fleetllm.cli import COMMANDS, main

FLEET_BAD_TOP = "workers: 2\nmodels: [{source: smollm2-135m, simulate: true}]\n"
FLEET_BAD_MODEL = "models:\n  - source: smollm2-135m\n    enginee: {max_num_seqs: 8}\n"
FLEET_BAD_ENGINE = "models:\n  - source: smollm2-135m\n    engine: {max_num_seq: 8}\n"
FLEET_BAD_REPLICAS = "models:\n  - source: smollm2-135m\n    replicas: {min: 3, max: 1}\n"

# (argv, a word the one line must hold); a row per mistake, grouped by command
CASES: list[tuple[list[str], str]] = [
    ([], "required"),
    (["serv"], "did you mean `serve`"),
    # worker
    (["worker", "--model", "{tmp}/none.gguf"], "not found"),
    (["worker", "--scheduling-policy", "lifo"], "invalid choice"),
    (["worker", "--kv-cache-dtype", "int4"], "fp8_e4m3"),
    (["router", "--state-url", "memcached://127.0.0.1:11211"], "redis://HOST:PORT"),
    (["serve", "--state-url", "redis://:secret@"], "redis://:***@"),
    (["worker", "--model", "hf://just-a-name"], "hf://org/name"),
    (["worker", "--model", "gs://bucket/model"], "not a store URI"),
    (["worker", "--tls-certfile", "{tmp}/cert.pem"], "--tls-keyfile"),
    (["worker", "--tls-certfile", "{tmp}/none.pem", "--tls-keyfile", "{tmp}/none.key"], "no such file"),
    (["worker", "--port", "eighty"], "invalid int value"),
    (["worker", "--max-num-sequences", "4"], "did you mean `--max-num-seqs`"),
    (["worker", "--cpus", "0-x"], "--cpus"),
    (["worker", "--simulate", "--count", "0"], "--count"),
    (["worker", "--enable-lora", "--lora-modules", "no-path"], "NAME=PATH"),
    (["worker", "--enable-lora", "--lora-modules", "a={tmp}/none"], "no such directory"),
    (["worker", "--enable-lora", "--lora-modules", "a={tmp}", "a={tmp}"], "given twice"),
    (["worker", "--lora-modules", "a={tmp}"], "--enable-lora"),
    (["worker", "--simulate", "--enable-lora", "--lora-modules", "a={tmp}"], "adapter_config.json"),
    (["worker", "--enable-lora", "--max-loras", "0"], "--max-loras"),
    (["router", "--workers", "http://127.0.0.1:1", "--lora-load-cost", "-1"], "--lora-load-cost"),
    (["worker", "--simulate", "--profile", "{tmp}/none.json"], "no such file"),
    (["worker", "--max-model-len", "-5"], "positive"),
    (["worker", "--urgent-step-rows", "-1"], "--urgent-step-rows -1: give 0 or more"),
    (["worker", "--priority-aging", "-2"], "--priority-aging -2.0: give 0 or more"),
    (["worker", "--kv-offload-gb", "-1"], "--kv-offload-gb"),
    (["worker", "--kv-disk-dir", "{tmp}", "--kv-disk-gb", "0"], "--kv-disk-gb"),
    (["worker", "--kv-remote", "http://:hunter2@host:6379"], "rediss://"),
    (["worker", "--kv-remote", "auto"], "fleetllm serve"),
    (["worker", "--speculative", "method=suffix,kk=4"], "unknown --speculative keys"),
    (["worker", "--simulate", "--kv-events-config", "tcp://*:5557"], "a JSON object"),
    # router
    (["router", "--tls-keyfile", "{tmp}/cert.pem"], "--tls-certfile"),
    (["router", "--profile", "{tmp}/none.json"], "no such file"),
    (["router", "--policy", "fastest"], "invalid choice"),
    (["router", "--scorer-weight", "latency=1"], "--scorer-weight latency=1"),
    (["router", "--flow-kv-usage", "2"], "--flow-kv-usage"),
    (["router", "--flow-worker-queue", "-1"], "--flow-worker-queue"),
    (["router", "--flow-headroom", "1"], "--flow-headroom"),
    (["router", "--traffic", "chat=stable"], "VARIANT:WEIGHT"),
    (["router", "--workers", "vllmm+http://127.0.0.1:1"], "unknown engine kind"),
    (["router", "--admin-token-file", "{tmp}/no-dir/token"], "--admin-token-file"),
    (["router", "--admin-token-file", "{tmp}/empty"], "is empty"),
    # doctor
    (["doctor", "--jsn"], "did you mean `--json`"),
    # serve
    (["serve", "--config", "{tmp}/none.yaml"], "no such file"),
    (["serve", "--config", "{tmp}/top.yaml"], "unknown key `workers`"),
    (["serve", "--config", "{tmp}/model.yaml"], "models[0].enginee`; did you mean `engine`"),
    (["serve", "--config", "{tmp}/engine.yaml"], "did you mean `max_num_seqs`"),
    (["serve", "--config", "{tmp}/replicas.yaml"], "min <= initial <= max"),
    (["serve", "--config", "{tmp}/broken.yaml"], "broken.yaml:3:1: not valid YAML"),
    (["serve", "--config", "{tmp}/list.yaml"], "`models[0]` must be a mapping"),
    (["serve", "--config", "{tmp}/source.yaml"], "models[0].source: model '/nowhere/m.gguf' not found"),
    (["serve", "--config", "{tmp}/top.yaml", "--simulate"], "--simulate"),
    (["serve", "--prefill", "1"], "--decode"),
    (["serve", "--kv-offload-gb", "-2"], "--kv-offload-gb"),
    (["serve", "--kv-remote", "redis://:hunter2@"], "--kv-remote"),
    (["serve", "--replicas", "0"], "1 or more"),
    (["serve", "--model", "{tmp}/none.gguf"], "not found"),
    # calibrate, generate, spec
    (["calibrate"], "--output"),
    (["calibrate", "--model", "{tmp}/none.gguf", "--output", "{tmp}/p.json"], "not found"),
    (["calibrate", "--output", "{tmp}/cert.pem/p.json"], "cannot create"),
    (["generate"], "prompt"),
    (["generate", "hello", "--model", "{tmp}/none.gguf"], "not found"),
    (["generate", "hello", "--model", "s3://"], "s3://bucket/prefix"),
    (["generate", "hello", "--temperature", "warm"], "invalid float value"),
    (["generate", "hello", "--max-tokens", "0"], "--max-tokens"),
    (["spec", "train"], "--method"),
    (["spec", "train", "--method", "medusa"], "invalid choice"),
    (["spec", "train", "--method", "eagle", "--target", "{tmp}/none"], "not found"),
    # keys
    (["keys"], "required"),
    (["keys", "--file", "{tmp}/keys.yaml", "revoke", "key-0000"], "no live key"),
    (["keys", "--file", "{tmp}/broken.yaml", "ls"], "not valid YAML"),
    (["keys", "--file", "{tmp}", "ls"], "cannot be read"),
    (["keys", "--file", "{tmp}/top.yaml", "ls"], "not a keys file"),
    (["keys", "create", "--rpm-limit", "many"], "invalid int value"),
    (["keys", "create", "--priority-floor", "soon"], "invalid int value"),
    (["keys", "create", "--weight", "0"], "not a positive number"),
    (["keys", "create", "--file", "{tmp}/keys.yaml"], "give it before `create`"),
    # capture
    (["capture", "ls", "{tmp}/no-captures"], "no such"),
    (["capture", "show", "{tmp}", "--since", "yesterday"], "--since"),
    (["capture", "ls", "s3://"], "s3://bucket"),
    (["capture", "forget", "{tmp}"], "--id"),
    (["capture", "ls", "s3://captures/x", "--s3-endpoint-url", "{closed}"], "Could not connect"),
    # models
    (["models", "pull", "hf://onlyname", "--cache-dir", "{tmp}/cache"], "hf://org/name"),
    (["models", "pull", "s3://", "--cache-dir", "{tmp}/cache"], "s3://bucket/prefix"),
    (["models", "pull", "hf://org/name", "--cache-dir", "{tmp}/cache", "--hf-endpoint", "{closed}"],
     "no cached copy"),
    (["models", "pull", "s3://bucket/model", "--cache-dir", "{tmp}/cache", "--s3-endpoint-url", "{closed}"],
     "S3 unreachable"),
    (["models", "rm", "hf://org/name", "--cache-dir", "{tmp}/cache"], "nothing cached"),
    (["models", "verify", "smollm2-135m", "--cache-dir", "{tmp}/cache"], "not a store URI"),
    (["models", "verify", "hf://org/name", "--cache-dir", "{tmp}/cache"], "nothing cached"),
    (["models", "prune"], "invalid choice"),
    # recommend
    (["recommend"], "--traffic"),
    (["recommend", "--traffic", "5", "--users", "10"], "not both"),
    (["recommend", "--traffic", "5", "--instances", "p9.huge"], "p5.48xlarge"),
    (["recommend", "--traffic", "5", "--slo", "ttft=5"], "unknown SLO"),
    (["recommend", "--traffic", "5", "--model", "llama-3.1-9b"], "did you mean `llama-3.1-8b`"),
    (["recommend", "--traffic", "5", "--catalogue", "{tmp}/none.yaml"], "no such file"),
    (["recommend", "--traffic", "5", "--profile", "{tmp}/none.json"], "--profile"),
    (["recommend", "--traffic", "5", "--workload", "bursty"], "unknown workload"),
    (["recommend", "--traffic", "5", "--workload", "isl=512"], "isl=MEAN"),
    (["recommend", "--traffic", "5", "--objective", "speed"], "invalid choice"),
    (["recommend", "--traffic", "5", "--out", "{tmp}/cert.pem/out"], "cannot create"),
    # fleet
    (["fleet", "restart", "--run-dir", "{tmp}"], "no fleetllm serve running"),
    (["fleet", "restart", "--port", "1", "--run-dir", "{tmp}"], "port 1"),
    (["fleet", "restart", "--config", "{tmp}/none.yaml"], "no such file"),
    (["fleet", "restart", "--port", "x"], "invalid int value"),
    # deploy
    (["deploy", "kubernetes"], "--config"),
    (["deploy", "kubernetes", "--config", "{tmp}/none.yaml"], "no such file"),
    (["deploy", "kubernetes", "--config", "{tmp}/model.yaml", "--out", "{tmp}/k8s"], "models[0].enginee"),
    (["deploy", "kubernetes", "--config", "{tmp}/identity.yaml", "--out", "{tmp}/k8s"],
     "`models[0].identity.role_arn`; did you mean `aws_role_arn`"),
    (["deploy", "helm"], "invalid choice"),
    # bench
    (["bench"], "--model"),
    (["bench", "--model", "m", "--workload", "trace"], "--trace"),
    (["bench", "--model", "m", "--slo", "speed_ms=5"], "unknown SLO"),
    (["bench", "--model", "m", "--extra-body", "{bad"], "not JSON"),
    (["bench", "--model", "m", "--concurrency", "1,two"], "--concurrency"),
    (["bench", "--model", "m", "--url", "{closed}"], "no server answers"),
    (["bench", "compare", "{tmp}/a.json"], "two result files"),
    (["bench", "compare", "{tmp}/none.json", "{tmp}/none2.json"], "no such file"),
]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The files the rows name, and an address where nothing listens."""
    tmp = tmp_path_factory.mktemp("bad-inputs")
    for name, text in (("top.yaml", FLEET_BAD_TOP), ("model.yaml", FLEET_BAD_MODEL), ("engine.yaml", FLEET_BAD_ENGINE),
                       ("replicas.yaml", FLEET_BAD_REPLICAS), ("broken.yaml", "models: [\n  {source: x\n"),
                       ("list.yaml", "models: [smollm2-135m]\n"),
                       ("source.yaml", "models: [{source: /nowhere/m.gguf}]\n"),
                       ("identity.yaml", "models: [{source: hf://o/m, identity: {role_arn: x}}]\n"),
                       ("cert.pem", "not checked before its key is given\n"),
                       ("keys.yaml", "keys: []\n"),
                       ("a.json", "{}"), ("empty", "")):
        (tmp / name).write_text(text)
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    return {"tmp": str(tmp), "closed": closed}


@pytest.mark.parametrize(("argv", "says"), CASES, ids=[f"{' '.join(a[:2]) or '(none)'}: {s}" for a, s in CASES])
def test_a_mistake_is_one_line_on_stderr_and_exit_2(argv, says, bad_files, capsys, monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_MAX_ATTEMPTS", "1")):  # a refused bucket: at once
        monkeypatch.setenv(name, value)
    code = main([a.replace("{tmp}", bad_files["tmp"]).replace("{closed}", bad_files["closed"]) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in err + out
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"fleetllm{' ' + argv[0] if argv and argv[0] in COMMANDS else ''}"), lines[0]
    assert says in lines[0], lines[0]


def test_every_command_has_rows():
    assert set(COMMANDS) <= {argv[0] for argv, _ in CASES if argv}


def test_recommend_takes_an_accelerator_for_every_instance_with_it():
    from fleetllm.recommend.catalogue import load_catalogue

    cat = load_catalogue()
    assert cat.select(["H100"]) == ["p5.48xlarge"]
    assert cat.select(["rtx pro 6000"]) == [i.name for i in cat.instances if i.accelerator.startswith("RTX PRO 6000")]
    assert cat.select(["L4", "g6.xlarge"]) == [i.name for i in cat.instances if i.accelerator == "L4"]


def test_a_real_bug_keeps_its_traceback(monkeypatch):
    """Only a user's mistake is one line: anything else escaping a command is a bug, shown in full."""
    import fleetllm.cli as cli

    def broken(args):  # noqa: ANN001, ANN202
        raise KeyError("a bug")

    monkeypatch.setitem(cli.COMMANDS, "keys", lambda sub: sub.add_parser("keys").set_defaults(func=broken))
    with pytest.raises(KeyError):
        main(["keys"])


def test_the_fleetllm_process_exits_2_with_one_line():
    """The installed command's own exit status (the process is the point)."""
    done = subprocess.run([sys.executable, "-m", "fleetllm.cli", "recommend", "--instances", "H100"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["fleetllm recommend: error: the load is missing: give --traffic RATE "
                                        "(requests/s, e.g. --traffic 5) or --users N"]
