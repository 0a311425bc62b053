"""The reasoning formats of the models jaxdp serves, as data, under SGLang's `--reasoning-parser` names.

From the model cards' chat templates and SGLang's reasoning parsers: all four write `<think>...</think>`;
- deepseek-r1: starts open (R1's template ends the prompt with `<think>`; R1-0528 writes it again, which is dropped);
- deepseek-v3 (V3.1 and later with thinking): starts closed; open when the request turns thinking on
  (`ReasoningParser(..., starts_open=True)`: the template then ends the prompt with `<think>`);
- glm45 (GLM-4.5 to GLM-5): starts closed, the model writes `<think>`; `<tool_call>` also ends the reasoning;
- kimi_k2: starts closed; `<|tool_calls_section_begin|>` also ends the reasoning.
"""

from jaxdp.api.parsers.reasoning import ReasoningFormat
from jaxdp.api.parsers.tool_formats import GLM_CALL_BEGIN, KIMI_SECTION_BEGIN

REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat("deepseek-r1", starts_open=True),
    "deepseek-v3": ReasoningFormat("deepseek-v3", starts_open=False),
    "glm45": ReasoningFormat("glm45", starts_open=False, closed_by=GLM_CALL_BEGIN),
    "kimi_k2": ReasoningFormat("kimi_k2", starts_open=False, closed_by=KIMI_SECTION_BEGIN),
}
