"""The CPU device's machinery (see tg_ds4/backend/__init__.py): importing this package changes nothing."""
