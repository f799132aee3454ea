"""What the model is shown of earlier turns (`proxy.history`): the template's rendering, or the sampled tokens.

A chat template may render a returned reply otherwise once it is history: Qwen3 and DeepSeek-R1 drop past
reasoning, GLM-4.5 inserts an empty think block, Cohere strips content, a tool call's JSON comes back re-spaced.
Then the sampled tokens and the template's rendering disagree about the history, and one of them is what the next
call's prompt holds:

* `template` (the default): the prompt is the template's rendering, as vLLM or SGLang would show the model.
  `sampled_history_kept` tells whether the sampled history reads as that rendering; where it does not, the call
  is rendered whole and recorded as a prefix break (`template_rewrites_history`): a new row, whose context is
  exactly what the model read.
* `sampled`: the prompt is the parent's prompt + its sampled tokens + the new messages only, even where the
  template would rewrite an earlier turn (`template_style.text_after_turn` finds the new messages' text in a
  rendering where the template drops or moves earlier text), so the conversation stays one concat row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.proxy.sessions import Session
    from pipeline.proxy.tokenize import ChatTokenizer, Extension
    from pipeline.proxy.trajectory import Interaction


def sampled_history_kept(tokenizer: ChatTokenizer, session: Session, parent: Interaction, ext: Extension) -> bool:
    """Whether the extended prompt reads as the template's rendering of the conversation: the parent's prompt text,
    its sampled tokens and the suffix equal the template's text.

    The parent's prompt text is its rendering kept on the session's node (under `history: template` every prompt
    is the template's rendering + its prefill, so that is the prompt's text); once the node has a child it is
    dropped, and the prompt's tokens are decoded instead."""
    kept = session.prompt_text(parent.id)
    if kept is not None:
        before = kept + str(parent.metadata.get("prefill") or "")
    else:
        before = tokenizer.decode(parent.prompt_ids, skip_special_tokens=False)
    sampled = tokenizer.decode(parent.output_ids, skip_special_tokens=False)
    return ext.full_text == before + sampled + ext.suffix_text
