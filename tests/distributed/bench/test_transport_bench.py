"""The separate-placement transport benchmark runs end to end at a tiny size (real Ray actors, a real gloo
weight group) and checks what the receivers hold."""

import json

import pytest


@pytest.mark.timeout(300)
def test_transport_bench_reports_both_transports(tmp_path, ray_cluster):
    from bench.transport_bench import main

    out = tmp_path / "transport.json"
    assert main(["--receivers", "2", "--total-mb", "32", "--bucket-mb", "8", "--iters", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for kind in ("broadcast", "object_store"):
        assert report[kind]["median_s"] > 0 and report[kind]["gb_per_s_per_receiver"] > 0
    assert report["broadcast_over_object_store_speed"] > 0
