"""``concise_error``: a refusal that jsonargparse quotes inside its own message reaches the user as the
refusal's line, found as the ``ConfigError`` object made in this process, never by parsing text.

Seen failing as the code was (a regular expression took any ``key=value: text`` line of the message
for a refusal): the forged line below came out as if lit-ablate had refused it.
"""

from __future__ import annotations

from lit_ablate.errors import ConfigError, quoted_refusal
from lit_ablate.parse_errors import concise_error


def test_a_refusal_quoted_inside_jsonargparse_s_message_is_its_own_line():
    refusal = ConfigError("trainer.strategy.init_args.checkpoint_every", 0, "use 1 or more")
    message = (
        "Does not validate against any of the Union subtypes\nSubtypes: [str, Strategy]\nErrors:\n"
        f"  - Problem with given class_path 'lit_ablate.strategies.FSDP2Strategy':\n    {refusal}\n"
        "  - Expected a <class 'str'>\nGiven value type: <class 'dict'>"
    )
    assert quoted_refusal(message) is refusal
    assert concise_error(message) == "trainer.strategy.init_args.checkpoint_every=0: use 1 or more"


def test_text_shaped_like_a_refusal_that_no_refusal_made_is_not_taken_for_one():
    forged = 'Parser key "data":\n  data.init_args.batch_size=3: a line that only looks like a refusal'
    assert quoted_refusal(forged) is None
    assert concise_error(forged) != "data.init_args.batch_size=3: a line that only looks like a refusal"
