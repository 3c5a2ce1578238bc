"""Constrained decoding (structured outputs): constraints compiled into grammars off the step
loop (`compiler`, from the constraint kinds in `grammars` and the JSON Schema checks in
`schema_check`), one matcher per sequence (`matcher`), and the token bitmask the sampler applies
to the rows that have one (`bitmask`). Built on llguidance; of the engine it imports only the
base modules (engine.errors)."""
