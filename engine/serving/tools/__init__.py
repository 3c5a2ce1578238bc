"""OpenAI tool calling: the request's ``tools`` / ``tool_choice`` fields (``request``), the JSON
Schema that forces a call (``constraint``), tools in the prompt when the model's chat template
ignores them (``rendering``), and tool calls out of the generated text, streamed or whole
(``splitter``, over ``json_scan`` for forced calls)."""
