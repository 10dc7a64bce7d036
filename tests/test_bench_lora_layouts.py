"""benchmarks/lora_layouts.py end to end at small shapes (its own check against the gather runs first)."""
from benchmarks import lora_layouts


def test_lora_layouts_runs_and_prints_every_case(capsys):
    assert lora_layouts.main(["--repeats", "1", "--calls", "2", "--d", "64", "--rank", "4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(lora_layouts.CASES)
    assert rows[2].split("|")[3].strip() == "-"                       # 33 slots: above the masked switch
