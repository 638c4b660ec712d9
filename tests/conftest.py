"""Session settings (two threads, offline Hub) and the shared fixtures. The tiny configurations and models the
fixtures build come from tiny_models.py, the one home of every test model factory."""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

# Deterministic, quiet, and small enough for two cores.
torch.set_num_threads(min(2, os.cpu_count() or 1))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Text runs prepare into datasets' cache (training/loopformer/data/text_cache.py): the session's own, never the user's;
# set before datasets is imported (it reads the variable once), and inherited by the commands tests start.
_datasets_cache = tempfile.mkdtemp(prefix="looped-tests-datasets-")
os.environ["HF_DATASETS_CACHE"] = _datasets_cache
atexit.register(shutil.rmtree, _datasets_cache, ignore_errors=True)

import loopformer_hf  # noqa: E402  (registers the Auto classes)
from support.tiny_models import randomize_modulation, tiny_loopformer_config  # noqa: E402


@pytest.fixture
def tiny_config():
    return tiny_loopformer_config()


@pytest.fixture
def tiny_model(tiny_config):
    torch.manual_seed(0)
    return randomize_modulation(loopformer_hf.LoopFormerForCausalLM(tiny_config)).eval()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny FPRMs on a shared 2-core machine run several times faster on one thread than on two: a module that wants
    it says `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
