"""The status page on the management listener: what runs where, live (`routes`, `view`,
`render`, `session`, and `static/`: one stylesheet and one script)."""
