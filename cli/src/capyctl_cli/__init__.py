"""capyctl: the CapyCTL command line, and the launcher of its roles."""
