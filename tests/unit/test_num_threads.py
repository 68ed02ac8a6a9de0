"""torch's CPU thread count for serve / generate / chat: --num-threads, else one core left for Python."""

from __future__ import annotations

import argparse

import pytest
import torch

from specserve.server import cli_args


@pytest.mark.parametrize(
    "requested,available,torch_default,want",
    [
        (None, 2, 2, 1),  # two cores: the engine and HTTP threads keep one
        (None, 1, 1, 1),
        (None, 16, 8, 8),  # never more than torch's own default (physical cores, or OMP_NUM_THREADS)
        (None, 4, 16, 3),  # a container's share, not the host's cores
        (3, 2, 2, 3),  # --num-threads wins
    ],
)
def test_choose_num_threads(requested, available, torch_default, want):
    assert cli_args.choose_num_threads(requested, available, torch_default) == want


def test_flag_sets_torch_threads_and_bad_values_name_the_field():
    parser = argparse.ArgumentParser()
    cli_args.add_engine_args(parser)
    before = torch.get_num_threads()
    try:
        assert cli_args.apply_num_threads(parser.parse_args(["--num-threads", "1"])) == 1
        assert torch.get_num_threads() == 1
        assert "num_threads" not in cli_args.engine_kwargs(parser.parse_args(["--num-threads", "1"]))
        with pytest.raises(ValueError, match="num_threads"):
            cli_args.apply_num_threads(parser.parse_args(["--num-threads", "0"]))
    finally:
        torch.set_num_threads(before)
    assert 1 <= cli_args.available_cpus()
