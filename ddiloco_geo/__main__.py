from ddiloco_geo.cli.main import main

raise SystemExit(main())
