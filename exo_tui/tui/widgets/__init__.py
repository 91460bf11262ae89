"""The console's widgets; each renders plain data from :mod:`exo_tui.cluster.view`."""
