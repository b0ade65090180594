from thinwire.cli.main import run

run()
