import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOLDENS = ROOT / "tests" / "goldens"
TINY = GOLDENS / "tiny"
TINY_FAMILIES = ("llama2", "llama31", "mistral", "qwen2", "qwen3", "smollm2")
