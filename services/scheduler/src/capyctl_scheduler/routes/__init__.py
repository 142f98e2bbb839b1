"""The management API's routes, one module per group; the status page's are `page.routes`."""
