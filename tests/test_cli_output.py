"""lockstep.cli.output: the progress line of the long commands (`make verify`'s check and verify)."""

import io

import torch

from lockstep.cli.output import LiveStatus


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_rewrites_one_line_on_a_terminal_and_stays_out_of_logs(monkeypatch, capsys):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    status = LiveStatus()
    status.show("engine setting 1/10")
    status.show("engine setting 2/10")
    status.say("a result")
    assert terminal.getvalue() == "\r\033[Kengine setting 1/10 (0s)\r\033[Kengine setting 2/10 (0s)\r\033[K"
    assert capsys.readouterr().out == "a result\n"
    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    status = LiveStatus()
    status.show("engine setting 1/10")
    status.say("a result")
    assert not status.active and log.getvalue() == ""
    assert capsys.readouterr().out == "a result\n"


def test_the_gate_reports_each_step_before_it_runs():
    from lockstep.model import Transformer
    from lockstep.model.config import ModelConfig
    from lockstep.tools import verify

    steps, lines = [], []
    report = verify.run(lambda dtype: Transformer.from_config(ModelConfig.tiny("llama"), seed=0, dtype=dtype),
                        [torch.float32], prompts=[[1, 2, 3], [4, 5]], max_new_tokens=2, settings=verify.SETTINGS[:2],
                        with_eager=False, log=lines.append, progress=steps.append)
    assert report.passed, lines
    assert steps == ["float32 greedy: engine setting 1/2, max_num_seqs=all, budget 64",
                     "float32 greedy: engine setting 2/2, max_num_seqs=1",
                     "float32 greedy: the trainer's logprobs of every completion",
                     "float32 T=0.8 top-k 40 top-p 0.95: engine setting 1/2, max_num_seqs=all, budget 64",
                     "float32 T=0.8 top-k 40 top-p 0.95: engine setting 2/2, max_num_seqs=1",
                     "float32 T=0.8 top-k 40 top-p 0.95: the trainer's logprobs of every completion",
                     "float32: the backward chain"]
    assert len(lines) == 3      # a row per sampling, and the backward chain
