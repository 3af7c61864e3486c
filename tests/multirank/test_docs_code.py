"""The documentation's fragments run: each page's `<!-- fragment -->` blocks, in order, in one
namespace, on 2 spawned Gloo ranks after pyreducer/testing/docs_code.py's prelude (a small model
`model`, this rank's batches `loader`, `loss_fn`), and the ranks end with the same parameters.
Whole scripts (`<!-- snippet: NAME -->`) run under torchrun in test_coming_from.py."""
import os

import pytest

from pyreducer.testing import docs_code, run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = docs_code.fragments_by_page(REPO)


def test_the_pages_have_fragments():
    assert len(PAGES) >= 5, sorted(PAGES)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_fragments_run_and_ranks_agree(page, tmp_path):
    sums = run_ranks(docs_code.fragment_worker, 2, timeout_s=240,
                     args=(page, PAGES[page], str(tmp_path)))
    assert sums[0] == sums[1], f"{page}: the ranks' parameters differ ({sums})"
