"""Progress of long work: a bar on a terminal, whole lines in a log file (minitf/progress.py)."""
import io

from minitf import progress


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_log_file_gets_whole_lines_every_interval_and_a_done_line(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    log = io.StringIO()
    with progress.bar(4 * 2 ** 20, "sample", unit="B", stream=log, every=30.0) as bar:
        bar.update(2 ** 20)                 # within the first 30 s: nothing yet
        clock.t = 31.0
        bar.set_postfix_str("1,234 lines/s")
        bar.update(2 ** 20)
        clock.t = 45.0
        bar.update(2 * 2 ** 20)             # 14 s after the last line: nothing
    assert "\r" not in log.getvalue()
    assert log.getvalue().splitlines() == ["sample: 50%, 2.0 MB of 4.0 MB, 31s, 1,234 lines/s",
                                           "sample: done, 4.0 MB of 4.0 MB, 45s, 1,234 lines/s"]


def test_quick_work_and_disabled_progress_write_nothing(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    log = io.StringIO()
    with progress.bar(100, "translate", unit="sent", stream=log) as bar:
        bar.update(100)
    with progress.bar(100, "translate", enabled=False, unit="sent", stream=log) as bar:
        clock.t = 100.0
        bar.update(100)
    assert log.getvalue() == ""


def test_a_terminal_gets_a_tqdm_bar():
    class Terminal(io.StringIO):
        def isatty(self):
            return True
    bar = progress.bar(10, "x", stream=Terminal())
    assert not isinstance(bar, progress.Lines) and hasattr(bar, "update")
    bar.close()
    assert progress.amount(1234, "sent") == "1,234 sent" and progress.amount(1536, "B") == "1.5 KB"


def test_a_capped_perplexity_is_printed_as_capped():
    # a diverged run's lines had printed exp(50) as "ppl 5184705528587072045056.00", a value like any other
    from minitf.validation import perplexity, shown_ppl
    assert shown_ppl(perplexity(3.0)) == "20.09"
    assert shown_ppl(perplexity(4.8e8)) == ">= exp(50) (capped: the run diverged?)"
    assert shown_ppl(perplexity(49.9)) != shown_ppl(perplexity(50.0))
