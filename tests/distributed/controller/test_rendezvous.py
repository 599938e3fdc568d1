"""A worker group's rendezvous port is bound when it is chosen, not later: nothing else can take it between
the choice and the group forming (a port picked free and bound later was taken in between once in CI)."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import errno, os, socket
    import torch, torch.distributed as dist
    from megarl.engines.megatron.parallel import bind_rendezvous_store, init_distributed

    port = bind_rendezvous_store(timeout_s=30)
    with socket.socket() as other:
        try:
            other.bind(("", port))
            raise SystemExit(f"port {port} was free after bind_rendezvous_store")
        except OSError as error:
            assert error.errno == errno.EADDRINUSE, error
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed(device="cpu", timeout_s=30)
    value = torch.ones(3)
    dist.all_reduce(value)
    assert value.tolist() == [1.0, 1.0, 1.0]
    dist.destroy_process_group()
    print("ok", port)
""")


def test_the_rendezvous_store_holds_its_port_from_the_moment_it_is_chosen():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stdout + result.stderr
