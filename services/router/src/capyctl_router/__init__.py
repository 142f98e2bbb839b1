"""CapyCTL router: the OpenAI-compatible endpoint in front of every deployment."""
