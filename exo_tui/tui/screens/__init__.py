"""The console's screens: main dashboard, node detail, hosts, help, confirmations and prompts."""
