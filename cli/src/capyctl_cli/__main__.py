"""`python -m capyctl_cli`: the capyctl command line."""

from capyctl_cli.main import main

main()
