"""The status page at ``/ui``: static HTML, JavaScript and CSS shipped in the package (static/),
served without the admin key because they hold no data; the page asks for the key and sends it
with every call to the admin API it shows (page.py serves the files)."""
