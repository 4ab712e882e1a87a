"""launch.py: what the torchrun re-launch takes from the environment."""
import socket

import pytest

from megatron_grpo.launch import launch_spec


def test_single_node_without_master_port_picks_a_free_port():
    # Hold 29500 (torchrun's default) so that a fixed default would clash.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        try:
            held.bind(("127.0.0.1", 29500))
        except OSError:
            pass                                  # taken already: the point stands
        spec = launch_spec(env={"NPROC_PER_NODE": "2"})
    assert spec.master_port != 29500 and 0 < spec.master_port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", spec.master_port))   # it was free


def test_master_port_and_multi_node_default_are_kept():
    assert launch_spec(env={"MASTER_PORT": "31234"}).master_port == 31234
    assert launch_spec(env={"NNODES": "2", "NODE_RANK": "1"}).master_port == 29500


def test_bad_master_port_names_it():
    with pytest.raises(ValueError, match="MASTER_PORT 70000"):
        launch_spec(env={"MASTER_PORT": "70000"})
