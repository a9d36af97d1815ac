"""The application built on the plugin: recipes, the commands, launchers and data sources.

Nothing under ``monai_fast`` outside this folder imports from it: the plugin (handlers, data,
tune, telemetry, report, bundle) stands on its own.
"""
