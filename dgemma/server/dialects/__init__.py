"""The client dialects besides OpenAI's Chat Completions: each module maps its bodies onto a chat or
completions body (routes.start_mapped, so every rule, limit and default is the task's, stated once) and
the pieces that come back onto its own answer and stream shapes. docs/server.md has the table."""
