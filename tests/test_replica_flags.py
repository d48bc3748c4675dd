"""The --replicas flags without a cluster: without Ray, `--replicas N` (N > 1) or `--ray-address` is one line that
says what to install; bad values are refused by name; one replica and no address need no Ray."""

from __future__ import annotations

import importlib.util

import pytest
from test_server import free_port

from minigpt.batch import build_parser, main
from minigpt.replicas import cluster, options


@pytest.fixture
def no_ray(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(options.importlib.util, "find_spec", lambda name, *a: None if name == "ray" else
                        find_spec(name, *a))


@pytest.mark.parametrize("flags", [["--replicas", "2"], ["--ray-address", "127.0.0.1:6379"]])
def test_without_ray_the_replica_flags_say_what_to_install(no_ray, tmp_path, capsys, flags):
    assert main(["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), *flags]) == 2
    err = capsys.readouterr().err
    assert err == 'minigpt.batch: error: replicas run on Ray: pip install "minigpt[ray]"\n'
    assert not (tmp_path / "out.jsonl").exists()


def test_one_replica_needs_no_ray(no_ray):
    args = build_parser().parse_args(["-i", "in", "-o", "out"])
    assert args.replicas == 1 and not options.uses_ray(args) and not options.ray_missing(args)


@pytest.mark.parametrize("flag, value", [("--replicas", "0"), ("--cpus-per-replica", "-1"),
                                         ("--gpus-per-replica", "nan")])
def test_bad_replica_flags_are_refused_by_name(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as stop:
        main(["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), flag, value])
    assert stop.value.code == 2
    assert f"{flag} must be" in capsys.readouterr().err


def test_replica_resources_follow_the_device():
    parse = build_parser().parse_args
    assert options.replica_resources(parse(["-i", "i", "-o", "o", "--device", "cuda"])) == {"num_cpus": 1.0,
                                                                                           "num_gpus": 1.0}
    assert options.replica_resources(parse(["-i", "i", "-o", "o", "--cpus-per-replica", "0.5"])) == {
        "num_cpus": 0.5, "num_gpus": 0.0}


def test_an_address_where_no_cluster_answers_is_one_line(tmp_path, capsys):
    """ray.init would retry for minutes, printing Ray's warnings; the head's port is tried first."""
    pytest.importorskip("ray")
    address = f"127.0.0.1:{free_port()}"
    source = tmp_path / "in.jsonl"
    source.write_text("", encoding="utf-8")
    assert main(["-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--ray-address", address, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"minigpt.batch: error: no Ray cluster answers at --ray-address {address}: ")
    assert err.count("\n") == 1 and not (tmp_path / "out.jsonl").exists()


def test_only_host_port_addresses_are_tried():
    for address in ("auto", "ray://127.0.0.1:10001", "127.0.0.1"):
        cluster.check_reachable(address)  # left to ray.init
    with pytest.raises(RuntimeError, match="no Ray cluster answers"):
        cluster.check_reachable(f"127.0.0.1:{free_port()}")
