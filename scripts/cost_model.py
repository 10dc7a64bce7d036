"""The decode cost model table: `python scripts/cost_model.py` = `python -m benchmarks.cost_model`
(the model lives in benchmarks/cost_model.py, beside the roofline benchmarks that use it)."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.cost_model import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
