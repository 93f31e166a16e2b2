"""The chat edge: what turns chat messages and OpenAI tools into a prompt and a grammar, and generated text back
into content and tool calls. It sits between the library's loop (core, which never imports it) and the wire
(`api` for `chat=True` and `Conversation`, `serving` for the chat and responses endpoints).

`templates` (a model's chat template: read, replaced, rendered to token ids), `tools` (one OpenAI function tool,
checked), `syntax` (how a template writes calls), `grammar` (the grammar every call the model writes follows) and
`parser` (calls read back out of the generated text, whole or while it streams).
"""
