from attnzoo.cli.scripts import bench

bench()
