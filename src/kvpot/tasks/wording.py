"""How passkey, niah and vt are phrased: several wordings (templates) of the instruction, the needle and
the question, because a cell scored on one phrasing measures the phrasing as much as the method
(issue 32; `kvpot eval --templates`). Template 0 is the original wording (RULER's, for niah and vt)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpot.errors import KvpotError

PASSKEY_HEADER = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "them. I will quiz you about the important information there."
)
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"

NIAH_HEADER = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards."
)
NIAH_NEEDLE = " One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION = (
    "\nWhat are all the special magic numbers for {keys} mentioned in the provided text? "
    "The special magic numbers for {keys} mentioned in the provided text are"
)



@dataclass(frozen=True)
class Wording:
    """One template of a task: how the instruction, the needle and the question are phrased.

    Several wordings exist because a cell scored on one phrasing measures the
    phrasing as much as the method (issue 32): ``kvpot eval --templates``
    spreads samples over them.  Template 0 is the original wording.
    """

    header: str
    needle: str  # {key} (passkey), {key} and {value} (niah), {name} and {value} (vt's first link)
    question: str  # starts with "\n"; niah: {keys}; vt: {value} and {count}
    hop: str = ""  # vt: a variable assigned another one, {name} and {prev}


PASSKEY_TEMPLATES = (
    Wording(PASSKEY_HEADER, PASSKEY_NEEDLE, PASSKEY_QUESTION),
    Wording(
        "Somewhere in the long document below, a secret code is written down. Read carefully and keep "
        "the code in mind, because you will be asked for it at the end.",
        " Write this down: the secret code is {key}. Again, the secret code is {key}.",
        "\nQuestion: what is the secret code mentioned in the document? Answer: the secret code is",
    ),
    Wording(
        "Below is a long text. One sentence in it gives a password; the rest does not matter.",
        " The password you need is {key}.",
        "\nWhich password did the text give? The password is",
    ),
)

NIAH_TEMPLATES = (
    Wording(NIAH_HEADER, NIAH_NEEDLE, NIAH_QUESTION),
    Wording(
        "The text below mentions a few numbers that belong to named items. Remember which number "
        "belongs to which item; you will be asked about them.",
        " The number that belongs to {key} is {value}.",
        "\nWhich numbers belong to {keys} according to the text? The numbers that belong to {keys} are",
    ),
    Wording(
        "Read the following document. Hidden in it are codes for certain names.",
        " Note that the code for {key} is {value}.",
        "\nQuestion: what is the code for {keys}? Answer: the code for {keys} is",
    ),
)

VT_HEADER = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VT_FIRST = " VAR {name} = {value}."
VT_HOP = " VAR {name} = VAR {prev}."
VT_QUESTION = (
    "\nQuestion: Find all variables that are assigned the value {value} in the text above. "
    "Answer: According to the chain(s) of variable assignment in the text above, {count} "
    "variables are assigned the value {value}, they are:"
)

VT_TEMPLATES = (
    Wording(VT_HEADER, VT_FIRST, VT_QUESTION, VT_HOP),  # RULER's
    Wording(
        "Variables below are set to a number or to another variable. Track them.",
        " Let {name} be {value}.",
        "\nWhich variables hold the number {value} at the end of the text? All {count} of them are:",
        " Let {name} equal {prev}.",
    ),
    Wording(
        "Follow the assignments hidden in this text.",
        " Set {name} to {value}.",
        "\nQuestion: list every variable whose value is {value}. Answer: the {count} variables are",
        " Set {name} to the value of {prev}.",
    ),
)


#: The wordings of the tasks that have several (the others have one).
TEMPLATES: dict[str, tuple[Wording, ...]] = {"passkey": PASSKEY_TEMPLATES, "niah": NIAH_TEMPLATES,
                                             "vt": VT_TEMPLATES}


def template_count(task: str) -> int:
    """How many templates ``task`` has (1 for tasks with one fixed wording)."""
    return len(TEMPLATES.get(task, (None,)))


def _wording(task: str, template: Any) -> Wording:
    """``TEMPLATES[task][template]``, or a KvpotError naming the valid indices."""
    wordings = TEMPLATES[task]
    if isinstance(template, bool) or not isinstance(template, int) or not 0 <= template < len(wordings):
        raise KvpotError(f"task {task!r} has templates 0 to {len(wordings) - 1}, got {template!r}.")
    return wordings[template]
