"""benchmarks/aa_blocks_synthetic.py drives the agent's real confirm_win on synthetic blocks: an identical
candidate is never accepted, and a candidate twice as fast almost always is."""

from __future__ import annotations

from benchmarks import aa_blocks_synthetic


def test_the_protocol_accepts_a_clear_win_and_never_an_identical_candidate(capsys):
    args = aa_blocks_synthetic.parse_args([])  # the script's own defaults: the noise of the `large` incumbent
    floor, identical = aa_blocks_synthetic.trial_rates(20, 1.0, 20, args)
    _, halved = aa_blocks_synthetic.trial_rates(20, 0.5, 20, args)
    assert 0.01 < floor < 0.3 and identical == 0.0 and halved >= 0.9
    assert aa_blocks_synthetic.main(["--trials", "2", "--aa-blocks", "4", "--truths", "1.0", "0.5"]) == 0
    table = capsys.readouterr().out
    assert "| A/A blocks | median floor | accepted at 1 | accepted at 0.5 |" in table and "\n| 4 | " in table
